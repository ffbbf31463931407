"""Consolidate a sharded lightning_scale checkpoint folder into one plain ``state_dict``.

``consolidate_checkpoint(path)`` reads the folder a Zero3DStrategy run wrote (``checkpoint.pt``,
``optim_rank{r}.pt``, ``meta.pt``) and returns ``{name: tensor}`` with every parameter whole, in fp32
(the fp32 master copies where mixed precision kept them), plus buffers. The result is a plain dict
of tensors: ``torch.save`` it and load it later with only ``torch.load`` + ``model.load_state_dict``.
A ZeRO-3 x tensor-parallel folder is merged over dp, then over tp (each rank's file records its tp rank
and the split of every sliced parameter), into the original model's keys and shapes.
``strip_prefix="model."`` turns LightningModule keys (``model.wte.weight``) into the inner model's keys.

Command line::

    python -m lightning_scale.zero.state_dict CKPT_DIR OUT.pt [--strip-prefix model.] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Optional, Union

SHARD_KEY = "zero3_model_shard"
# --dtype / dtype= by name; "keep": each tensor's own dtype. torch is imported only past argparse (fast --help).
DTYPES = ("float32", "bfloat16", "float16", "float64", "keep")


def consolidate_checkpoint(path: str, *, strip_prefix: str = "", dtype: Union["torch.dtype", str, None] = "float32",
                           out: Optional[str] = None) -> Dict[str, "torch.Tensor"]:
    """``dtype``: a floating ``torch.dtype`` or its name (``"float32"``, the default), or None / ``"keep"``."""
    import torch

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)} or a torch.dtype")
        dtype = None if dtype == "keep" else getattr(torch, dtype)
    with torch.no_grad():
        return _consolidate(path, strip_prefix, dtype, out)


def _consolidate(path: str, strip_prefix: str, dtype, out: Optional[str]) -> Dict[str, "torch.Tensor"]:
    import torch

    from lightning_scale.checkpoint import folder  # checks each file against the manifest as it is read

    path = folder.resolve(path)  # a save interrupted while swapping folders left the complete one beside it
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a sharded checkpoint folder")
    meta = folder.read_manifest(path)
    folder.verify(path, meta)
    folder.warn_unverified(path, meta)
    world = int(meta["world_size"])

    def _load(name: str):
        return folder.load_file(path, name, meta)

    base = _load("checkpoint.pt")
    state: Dict[str, torch.Tensor] = {k: v for k, v in base.get("state_dict", {}).items()}
    first = _load("optim_rank0.pt")
    if SHARD_KEY in first:
        shards = [first[SHARD_KEY]] + [_load(f"optim_rank{r}.pt")[SHARD_KEY]
                                       for r in range(1, world)]
        tp = int(first[SHARD_KEY].get("tp", {}).get("size", 1))
        pp = int(first[SHARD_KEY].get("pp", {}).get("size", 1))
        # per (pipeline stage, tp rank): the dp shards, in dp-rank order
        groups: Dict[tuple, Dict[int, dict]] = {}
        for sh in shards:
            key = (int(sh.get("pp", {}).get("rank", 0)), int(sh.get("tp", {}).get("rank", 0)))
            groups.setdefault(key, {}).setdefault(int(sh["rank"]), sh)
        expected = [(s, t) for s in range(pp) for t in range(tp)]
        if sorted(groups) != expected:
            raise ValueError(f"{path}: expected files for (pipeline stage, tp rank) {expected}, found {sorted(groups)}")
        for s in range(pp):
            local = [_merge_dp(groups[(s, t)], groups[(s, t)][0]["layout"]) for t in range(tp)]
            state.update(local[0])
            if tp > 1:
                from lightning_scale.tensor_parallel.sharding import merge_shards

                for name, spec in groups[(s, 0)][0]["tp"]["specs"].items():
                    state[name] = merge_shards([local[t][name] for t in range(tp)], spec)
        for sh in shards:  # tied parameters under every name the model's state_dict() uses
            for alias, name in sh.get("aliases", {}).items():
                if name in state:
                    state.setdefault(alias, state[name])
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    if strip_prefix:
        state = {k[len(strip_prefix):]: v for k, v in state.items() if k.startswith(strip_prefix)}
    if out:
        torch.save(state, out)
    return state


def _merge_dp(ranks: Dict[int, dict], layout: dict) -> Dict[str, "torch.Tensor"]:
    """One tp rank's parameters, whole over dp: each bucket's dp shards concatenated and cut into slots."""
    import torch

    dp = int(layout["world_size"])
    if sorted(ranks) != list(range(dp)):
        raise ValueError(f"expected ZeRO-3 shards of dp ranks 0..{dp - 1}, found {sorted(ranks)}")
    out: Dict[str, torch.Tensor] = {}
    index = 0
    for unit in layout["units"]:
        for bucket in unit["buckets"]:
            pieces = []
            for r in range(dp):
                master = ranks[r]["masters"][index]
                pieces.append(master if master is not None else ranks[r]["shards"][index])
            full = torch.cat([p.reshape(-1) for p in pieces])
            for name, offset, numel, shape in bucket["slots"]:
                out[name] = full[offset:offset + numel].view(tuple(shape)).clone()
            index += 1
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lightning_scale.zero.state_dict", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--strip-prefix", default="")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, float64 or 'keep'")
    args = ap.parse_args(argv)
    if args.dtype not in DTYPES:
        print(f"error: --dtype={args.dtype!r}: use float32, bfloat16, float16, float64 or keep", file=sys.stderr)
        return 2
    from lightning_scale.checkpoint.cli import _not_a_folder  # standard library only

    if _not_a_folder(args.checkpoint):  # consolidate_checkpoint's message, before torch is imported (~2 s)
        print(f"error: {args.checkpoint} is not a sharded checkpoint folder", file=sys.stderr)
        return 2
    from lightning_scale.checkpoint.folder import CheckpointError

    try:
        state = consolidate_checkpoint(args.checkpoint, strip_prefix=args.strip_prefix, dtype=args.dtype,
                                       out=args.out)
    except (OSError, ValueError, CheckpointError) as err:  # a missing / incomplete folder: the message, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = sum(v.numel() for v in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {n:,} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
