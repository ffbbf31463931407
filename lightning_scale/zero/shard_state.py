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


def _layout_difference(saved: Dict[str, Any], mine: Dict[str, Any]) -> str:
    """What differs between a checkpoint's stage-3 layout and this run's, in words: the units first."""
    if saved.get("world_size") != mine["world_size"]:
        return f"written by {saved.get('world_size')} data-parallel ranks, this run has {mine['world_size']}"
    names = [u["name"] for u in saved.get("units", [])]
    here = [u["name"] for u in mine["units"]]
    if names != here:
        def show(units):
            return "[" + ", ".join(units[:6]) + (f", ... ({len(units)} units)" if len(units) > 6 else "") + "]"
        return f"its units are {show(names)}, this run's {show(here)}"
    dtypes = [sorted({bk["dtype"] for u in lay["units"] for bk in u["buckets"]}) for lay in (saved, mine)]
    if dtypes[0] != dtypes[1]:
        return (f"its parameter shards are {', '.join(dtypes[0])}, this run's {', '.join(dtypes[1])} (another "
                "precision: the sharded format resumes at its own)")
    for a, b in zip(saved["units"], mine["units"]):
        if a != b:
            params = sorted({s[0] for bk in a["buckets"] for s in bk["slots"]} ^
                            {s[0] for bk in b["buckets"] for s in bk["slots"]})
            what = f"parameters {params[:4]} in one of them only" if params else "other buckets (parameter groups, " \
                "dtypes or shapes)"
            return f"unit {a['name']!r} differs: {what}"
    return "the units' buckets differ"


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
    mine, theirs = layout(sp), state["layout"]
    if mine != theirs:
        raise ValueError("zero.stage=3 checkpoint layout does not match this run: " + _layout_difference(theirs, mine)
                         + "; resume with the same configuration (zero.unit_modules, the model, its parameter groups) "
                         "or save with checkpoint_format='universal', which resumes on any layout")
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
