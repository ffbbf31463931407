"""ZeRO-3 state on one rank: the layout record, this rank's shards out and in, and the full (consolidated) state.

The methods of :class:`~lightning_scale.zero.param_shard.ShardedParameters` with the same names call these.
:func:`layout` is what a checkpoint records to refuse a mismatched resume; :func:`shard_state_dict` /
:func:`load_shard_state_dict` save and restore this rank's parameter shards and separate fp32 masters;
:func:`full_state_dict` all-gathers every bucket (a collective) into the original names and shapes.
Layout-free (resharding) checkpoints are :mod:`lightning_scale.checkpoint.engine_pieces`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from lightning_scale.comm import collectives as C

if TYPE_CHECKING:  # pragma: no cover
    from lightning_scale.zero.param_shard import ShardedParameters


def layout(sp: "ShardedParameters") -> Dict[str, Any]:
    return {"world_size": sp.world, "units": [
        {"name": u.name, "kind": u.kind, "buckets": [
            {"group": b.group_id, "padded_numel": b.bucket.padded_numel, "numel": b.bucket.numel,
             "dtype": str(b.full.dtype),
             "slots": [(sp.names[id(s.param)], s.offset, s.numel, tuple(s.shape)) for s in b.bucket.slots]}
            for b in u.buckets]} for u in sp.units]}


def aliases(sp: "ShardedParameters") -> Dict[str, str]:
    """The other names of tied parameters (a Hugging Face ``lm_head.weight`` tied to the embedding) -> the name
    their shard is stored under: the model's own ``state_dict()`` lists both, so a consolidated one does too."""
    return {n: sp.names[id(p)] for n, p in sp.root.named_parameters(remove_duplicate=False)
            if sp.names.get(id(p), n) != n}


def shard_state_dict(sp: "ShardedParameters") -> Dict[str, Any]:
    """This rank's parameter shards (+ fp32 masters when separate) and the layout to consolidate them."""
    return {"rank": sp.rank, "layout": layout(sp), "aliases": aliases(sp),
            "shards": [b.shard.detach().cpu().clone() for b in sp.buckets()],
            "masters": [None if (b.master is None or b.master_aliased) else b.master.detach().cpu().clone()
                        for b in sp.buckets()]}


@torch.no_grad()
def load_shard_state_dict(sp: "ShardedParameters", state: Dict[str, Any]) -> None:
    if layout(sp) != state["layout"]:
        raise ValueError("zero.stage=3 checkpoint layout does not match this run (different model, units, "
                         "param groups or data-parallel size); resume with the same configuration")
    for b, shard, master in zip(sp.buckets(), state["shards"], state["masters"]):
        b.shard.copy_(shard)
        if master is not None and b.master is not None and not b.master_aliased:
            b.master.copy_(master)
    for u in sp.units:
        if u.kind == "persistent":
            u.gathered = False
            for b in u.buckets:
                sp._alloc(b)
            sp._gather(u)
        else:
            sp._free(u)


@torch.no_grad()
def full_state_dict(sp: "ShardedParameters", dtype: Optional[torch.dtype] = torch.float32,
                    rank0_only: bool = False) -> Dict[str, torch.Tensor]:
    """All parameters (fp32 masters where they exist) and buffers, unsharded; a collective."""
    out: Dict[str, torch.Tensor] = {}
    for b in sp.buckets():
        src = b.master if (b.master is not None and not b.master_aliased) else b.shard
        src = src.to(sp.device, dtype=dtype or src.dtype)
        full = torch.empty(b.bucket.padded_numel, dtype=src.dtype, device=sp.device)
        C.all_gather(full, src, sp.group, tag="consolidate")
        if rank0_only and sp.rank != 0:
            continue
        for s in b.bucket.slots:
            out[sp.names[id(s.param)]] = full[s.offset:s.offset + s.numel].view(s.shape).cpu().clone()
    if rank0_only and sp.rank != 0:
        return {}
    for p in sp.frozen:
        out[sp.names[id(p)]] = p.detach().cpu().clone()
    for n, buf in sp.root.named_buffers():
        out[n] = buf.detach().cpu().clone()
    return out
