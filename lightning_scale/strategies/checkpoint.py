"""Sharded checkpoints: one folder per checkpoint, one optimizer-shard file per rank, complete or absent.

Layout of ``<path>/`` (``<path>`` is what Lightning calls the checkpoint file, e.g. ``epoch=0-step=8.ckpt``)::

    checkpoint.pt          rank 0: everything Lightning saves except the optimizer states
    optim_rank{r}.pt       rank r: its optimizer shards (state, fp32 masters, loss scaler, layout) and, at
                           ZeRO stage 3, its parameter shards (``zero3_model_shard``)
    meta.pt                the manifest, written last: world size, format version, the save's token and
                           every file's size and CRC32

Every rank writes into a fresh staging folder and rank 0 swaps it into place only once the manifest is
written (:mod:`lightning_scale.checkpoint.folder`), so overwriting ``last.ckpt`` can never leave a folder
that mixes two steps, and a crash at any moment leaves the previous good checkpoint loadable.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

from lightning_scale.checkpoint import folder
from lightning_scale.checkpoint.folder import CheckpointError

FORMAT_VERSION = folder.FORMAT_VERSION


def save_sharded(checkpoint: Dict[str, Any], path: str, rank: int, world_size: int,
                 broadcast: Callable[[Any], Any], gather: Callable[[Any], List[Any]],
                 per_rank_keys: Sequence[str] = ("optimizer_states",)) -> None:
    """Collective. ``broadcast(obj)`` returns rank 0's object on every rank; ``gather(obj)`` returns every
    rank's object (a list in rank order) at least on rank 0."""
    token = broadcast(folder.new_token() if rank == 0 else None)
    staging = folder.staging_path(path, token)
    mine = {k: checkpoint[k] for k in per_rank_keys if k in checkpoint}
    mine.setdefault("optimizer_states", [])
    records = {f"optim_rank{rank}.pt": folder.write_file(staging, f"optim_rank{rank}.pt", mine)}
    if rank == 0:
        rest = {k: v for k, v in checkpoint.items() if k not in per_rank_keys}
        records["checkpoint.pt"] = folder.write_file(staging, "checkpoint.pt", rest)
    folder.fault_point("after_rank_file", rank)
    every = gather(records)  # also the barrier: every rank's files are written and fsync'ed
    if rank == 0:
        files: Dict[str, Dict[str, int]] = {}
        for rec in every:
            files.update(rec)
        folder.commit(path, token, files, world_size=world_size)
    broadcast(None)  # nobody returns (and, e.g., loads or removes it) before the folder is in place


def load_sharded(path: str, rank: int, world_size: int) -> Dict[str, Any]:
    path = folder.resolve(path)
    meta = folder.read_manifest(path)
    folder.verify(path, meta)  # every listed file present, with its size: names a missing / truncated shard
    folder.warn_unverified(path, meta)
    if meta["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {path} was written by {meta['world_size']} ranks; this run has {world_size}. "
            "Resume with the same number of devices x nodes"
        )
    checkpoint = folder.load_file(path, "checkpoint.pt", meta)
    shard = folder.load_file(path, f"optim_rank{rank}.pt", meta)
    checkpoint.update(shard)  # optimizer_states (+ zero3_model_shard at stage 3)
    return checkpoint


def remove_sharded(path: str) -> None:
    folder.remove(path)
