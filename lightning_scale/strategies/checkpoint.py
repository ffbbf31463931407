"""Sharded checkpoints: one folder per checkpoint, one optimizer-shard file per rank, written atomically.

Layout of ``<path>/`` (``<path>`` is what Lightning calls the checkpoint file, e.g. ``epoch=0-step=8.ckpt``)::

    checkpoint.pt          rank 0: everything Lightning saves except the optimizer states
    optim_rank{r}.pt       rank r: its optimizer shards (state, fp32 masters, loss scaler, layout)
    meta.pt                world size and format version, written last (its presence marks completion)

Each file is written to a temporary name and renamed, so a crash never leaves a half-written file
under the final name.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Dict

import torch

FORMAT_VERSION = 1


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_sharded(checkpoint: Dict[str, Any], path: str, rank: int, world_size: int,
                 barrier: Callable[[], None]) -> None:
    os.makedirs(path, exist_ok=True)
    _atomic_save({"optimizer_states": checkpoint.get("optimizer_states", [])}, os.path.join(path, f"optim_rank{rank}.pt"))
    if rank == 0:
        rest = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
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
    checkpoint["optimizer_states"] = shard["optimizer_states"]
    return checkpoint


def remove_sharded(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
