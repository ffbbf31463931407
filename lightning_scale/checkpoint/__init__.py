"""Checkpoint formats: folders that are complete or absent (:mod:`.folder`)."""

from lightning_scale.checkpoint.folder import CheckpointError

__all__ = ["CheckpointError"]
