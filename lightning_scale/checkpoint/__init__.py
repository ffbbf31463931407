"""Checkpoint formats.

- :mod:`.folder`: folders that are complete or absent (staged writes, checksummed manifest, atomic swap);
- :mod:`.layout`: the layout-free piece model (what a rank owns, in the original tensors' coordinates);
- :mod:`.dcp_format`: save / load pieces on torch.distributed.checkpoint (reshard on load);
- :mod:`.hf`: Hugging Face safetensors in and out, streaming;
- :mod:`.async_save`: background saves of a step-boundary snapshot;
- ``python -m lightning_scale.checkpoint``: inspect, consolidate, export-hf (:mod:`.cli`).

Everything, :class:`CheckpointError` included, loads on first use: importing the package imports no torch, so
the CLI's ``--help`` and its errors for a missing folder start fast.
"""

_LAZY = {
    "CheckpointError": "folder",
    "Chunk": "layout", "Piece": "layout", "TPSlice": "layout", "flat_piece": "layout", "tensor_piece": "layout",
    "flat_range_to_chunks": "layout", "save": "dcp_format", "load": "dcp_format", "detect_format": "dcp_format",
    "LoadResult": "dcp_format", "load_hf_weights_": "hf", "load_hf_pieces_": "hf", "read_region": "hf",
    "export_hf": "hf", "export_hf_from_checkpoint": "hf", "AsyncSaver": "async_save",
}

__all__ = [
    "AsyncSaver", "CheckpointError", "Chunk", "LoadResult", "Piece", "TPSlice", "detect_format", "export_hf",
    "export_hf_from_checkpoint", "flat_piece", "flat_range_to_chunks", "load", "load_hf_pieces_", "load_hf_weights_",
    "read_region", "save", "tensor_piece",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"lightning_scale.checkpoint.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'lightning_scale.checkpoint' has no attribute {name!r}")
