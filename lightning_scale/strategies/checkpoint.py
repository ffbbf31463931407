"""Sharded checkpoints: one folder per checkpoint, one optimizer-shard file per rank, written atomically.

Layout of ``<path>/`` (``<path>`` is what Lightning calls the checkpoint file, e.g. ``epoch=0-step=8.ckpt``)::

    checkpoint.pt          rank 0: everything Lightning saves except the optimizer states
    optim_rank{r}.pt       rank r: its optimizer shards (state, fp32 masters, loss scaler, layout) and, at
                           ZeRO stage 3, its parameter shards (``zero3_model_shard``)
    meta.pt                world size and format version, written last (its presence marks completion)

Each file is written to a temporary name and renamed, so a crash never leaves a half-written file
under the final name.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Dict, Sequence

import torch

FORMAT_VERSION = 1


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_sharded(checkpoint: Dict[str, Any], path: str, rank: int, world_size: int,
                 barrier: Callable[[], None], per_rank_keys: Sequence[str] = ("optimizer_states",)) -> None:
    os.makedirs(path, exist_ok=True)
    mine = {k: checkpoint[k] for k in per_rank_keys if k in checkpoint}
    mine.setdefault("optimizer_states", [])
    _atomic_save(mine, os.path.join(path, f"optim_rank{rank}.pt"))
    if rank == 0:
        rest = {k: v for k, v in checkpoint.items() if k not in per_rank_keys}
        _atomic_save(rest, os.path.join(path, "checkpoint.pt"))
    barrier()
    if rank == 0:
        _atomic_save({"world_size": world_size, "version": FORMAT_VERSION}, os.path.join(path, "meta.pt"))
    barrier()


def load_sharded(path: str, rank: int, world_size: int) -> Dict[str, Any]:
    meta_path = os.path.join(path, "meta.pt")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path} is not a complete lightning_scale sharded checkpoint (no meta.pt)")
    meta = torch.load(meta_path, map_location="cpu", weights_only=False)
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} ranks; this run has {world_size}. "
            "Resume with the same number of devices x nodes"
        )
    checkpoint = torch.load(os.path.join(path, "checkpoint.pt"), map_location="cpu", weights_only=False)
    shard = torch.load(os.path.join(path, f"optim_rank{rank}.pt"), map_location="cpu", weights_only=False)
    checkpoint.update(shard)  # optimizer_states (+ zero3_model_shard at stage 3)
    return checkpoint


def remove_sharded(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
