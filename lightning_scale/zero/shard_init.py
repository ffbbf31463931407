"""ZeRO-3 deferred initialization: fill every unit's shards from the model, one unit at a time.

``ShardedParameters.shard_model()`` (:mod:`lightning_scale.zero.param_shard`) runs :func:`shard_model` once after the units and buckets are built. For each unit: its flat buffer is allocated in the parameters'
own dtype, ``meta`` parameters are materialized straight into it as views (real ones are copied in), rank 0 runs
the initializer (the nearest ancestor's ``init_module(name, module)``, else ``reset_parameters()``; see
:mod:`lightning_scale.materialize`), the buffer is broadcast from the group's rank 0 and each rank keeps its
slice. Then frozen parameters and buffers are materialized whole and broadcast. No rank ever holds more than
one unit in full.

Pretrained weights recorded on the model (:mod:`lightning_scale.pretrained`): a unit whose parameters all come
from the file is not initialized and broadcast; each rank reads only its own dp shard of each flat bucket from the
safetensors files (:func:`_read_unit_shards`), so no rank holds a unit's values in full either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError
from lightning_scale.materialize import allocate_, init_one, init_owners, swap_in
from lightning_scale.zero import param_guard

if TYPE_CHECKING:  # pragma: no cover
    from lightning_scale.zero.param_shard import ShardedBucket, ShardedParameters

Owners = List[Tuple[str, nn.Module]]


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters(recurse=False)) or any(
        t.is_meta for t in module.buffers(recurse=False))


def group_src(sp: "ShardedParameters") -> int:
    """The global rank of the shard group's rank 0 (the broadcast source)."""
    import torch.distributed as dist

    if sp.world == 1:
        return 0
    return dist.get_global_rank(sp.group, 0) if sp.group is not None else 0


def modules_by_unit(sp: "ShardedParameters") -> Dict[int, List[Tuple[str, nn.Module]]]:
    """Each module with direct parameters/buffers, assigned to the unit that owns its first parameter (-1: none)."""
    out: Dict[int, List[Tuple[str, nn.Module]]] = {}
    for name, m in sp.root.named_modules():
        own = list(m.parameters(recurse=False))
        if not own and not list(m.buffers(recurse=False)):
            continue
        units = [sp._where[id(p)] for p in own if id(p) in sp._where]
        out.setdefault(units[0].index if units else -1, []).append((name, m))
    return out


def materialize_modules(device: torch.device, modules: List[Tuple[str, nn.Module]], owners: Owners,
                        init: bool = True, was_meta: Optional[set] = None, reader=None) -> None:
    """Allocate meta tensors on the device; ``init``: run the initializer (rank 0; the others receive rank 0's values
    by broadcast, so their random state never matters and the work is done once). ``was_meta``: modules that were
    on meta before their bucketed parameters were materialized. ``reader``: modules under a pretrained source are
    read from it instead of initialized."""
    for name, m in modules:
        if has_meta(m) or (was_meta is not None and id(m) in was_meta):
            # Swap contents instead of Module.to_empty (which makes new Parameter objects): the optimizer and the
            # buckets keep the parameters they were given.
            allocate_(m, device)
            if init and reader is not None and reader.covers(f"{name}." if name else ""):
                reader.fill_module_(name, m, owners)
            elif init:
                init_one(name, m, owners)
        else:
            for t in list(m.parameters(recurse=False)):
                if t.device != device:
                    t.data = t.data.to(device)


def _unit_buffers(sp: "ShardedParameters", unit) -> List[torch.Tensor]:
    """The unit's flat buffers in the parameters' own dtype, each parameter a view into its buffer: meta parameters
    are materialized straight into it (initialized in place later), real ones are copied in. No other full copy."""
    tmps = []
    for b in unit.buckets:
        src_dtype = b.bucket.slots[0].param.dtype
        if src_dtype == b.full.dtype:
            sp._alloc(b)
            tmp = b.full
        else:
            tmp = torch.empty(b.bucket.padded_numel, dtype=src_dtype, device=sp.device)
        tmp[b.bucket.numel:].zero_()
        for slot in b.bucket.slots:
            view = tmp[slot.offset:slot.offset + slot.numel].view(slot.shape)
            p = slot.param
            if p.is_meta:
                # A real (empty) tensor first, then `.data` = the view: the parameter keeps a version counter of
                # its own, so writes into the flat buffer (gathers) never look like in-place changes of a tensor
                # autograd saved.
                swap_in(p, torch.empty(0, dtype=p.dtype, device=sp.device))
            else:
                view.copy_(p.detach())
            p.data = view
        tmps.append(tmp)
    return tmps


def _keep_shard(sp: "ShardedParameters", unit, b: "ShardedBucket", tmp: torch.Tensor) -> None:
    """Broadcast the initialized buffer from rank 0 and keep this rank's slice (+ the exact master values)."""
    C.broadcast(tmp, src=group_src(sp), group=sp.group, tag="init")
    lo, hi = b.bucket.shard_range(sp.rank)
    b.shard.copy_(tmp[lo:hi])
    # Mixed precision: the fp32 master shard starts from the exact values, not the cast ones.
    b.init_master = tmp[lo:hi].clone() if tmp.dtype != b.shard.dtype else None
    if tmp is not b.full:
        sp._alloc(b)  # views can only be cut from allocated storage; freed again by the caller
        if unit.kind == "persistent":
            b.full.copy_(tmp)
        for slot in b.bucket.slots:
            slot.param.data = b.full[slot.offset:slot.offset + slot.numel].view(slot.shape)


def _reads_whole_unit(sp: "ShardedParameters", unit, reader) -> bool:
    return reader is not None and bool(unit.params) and all(
        p.is_meta and reader.covers(sp.names[id(p)]) for p in unit.params)


def _read_unit_shards(sp: "ShardedParameters", unit, modules: List[Tuple[str, nn.Module]], owners: Owners,
                      reader) -> None:
    """A unit of pretrained parameters: each rank reads its dp shard ``[lo, hi)`` of every bucket from the files
    (the persistent unit, kept gathered, reads its buckets whole); no initializer, no broadcast."""
    src_dtypes = [b.bucket.slots[0].param.dtype for b in unit.buckets]
    for b in unit.buckets:
        sp._alloc(b)  # views can only be cut from allocated storage: its pages stay untouched, freed below
        for slot in b.bucket.slots:
            swap_in(slot.param, torch.empty(0, dtype=slot.param.dtype, device=sp.device))
            slot.param.data = b.full[slot.offset:slot.offset + slot.numel].view(slot.shape)
    bucketed = {id(p) for p in unit.params}
    for name, m in modules:  # buffers (rotary inv_freq recomputed) and frozen parameters, whole
        allocate_(m, sp.device)
        reader.fill_module_(name, m, owners, skip=bucketed)
    for b, src_dtype in zip(unit.buckets, src_dtypes):
        whole = unit.kind == "persistent"
        lo, hi = (0, b.bucket.padded_numel) if whole else b.bucket.shard_range(sp.rank)
        if whole:
            tmp = b.full if src_dtype == b.full.dtype else torch.zeros(hi, dtype=src_dtype, device=sp.device)
            tmp[b.bucket.numel:].zero_()
        else:
            tmp = b.shard if src_dtype == b.shard.dtype else torch.zeros(hi - lo, dtype=src_dtype, device=b.shard.device)
        items = []
        for slot in b.bucket.slots:
            a, e = slot.shard_overlap(lo, hi)  # the slot's elements [a, e) sit at tmp[slot.offset + a - lo:...]
            if a < e:
                off = slot.offset + a - lo
                items.append(reader.flat_item(sp.names[id(slot.param)], slot.param, tmp[off:off + e - a], a))
        reader.load_(items)
        reader.release()  # the file pages this rank mapped for the bucket are let go
        slo, shi = b.bucket.shard_range(sp.rank)
        mine = tmp[slo:shi] if whole else tmp
        if mine is not b.shard:
            b.shard.copy_(mine)
        # Mixed precision: the fp32 master shard starts from the file's values, not the cast ones.
        b.init_master = mine.clone() if mine.dtype != b.shard.dtype else None
        if whole and tmp is not b.full:
            b.full.copy_(tmp)


@torch.no_grad()
def shard_model(sp: "ShardedParameters") -> None:
    """Fill every shard of ``sp`` from its model (materializing ``meta`` units one at a time), free the full copies.

    Each unit's values are broadcast from rank 0 (one bucket at a time), so ranks agree even when their random
    states differ; rank 0's values are what a single-process run with the same seed builds."""
    from lightning_scale.pretrained import weight_reader

    owners = init_owners(sp.root)
    by_module = modules_by_unit(sp)
    reader = weight_reader(sp.root)  # pretrained sources recorded on the model; None: initialize everything
    param_guard.name_params(sp.names, (p for u in sp.units for p in u.params))
    for unit in sp.units:
        modules = by_module.get(unit.index, [])
        if _reads_whole_unit(sp, unit, reader):
            _read_unit_shards(sp, unit, modules, owners, reader)
        else:
            was_meta = {id(m) for _, m in modules if has_meta(m)}
            tmps = _unit_buffers(sp, unit)
            # Buffers / frozen parameters of the unit's modules, then the initializer (rank 0 only).
            materialize_modules(sp.device, modules, owners, init=sp.rank == 0, was_meta=was_meta, reader=reader)
            for b, tmp in zip(unit.buckets, tmps):
                _keep_shard(sp, unit, b, tmp)
            del tmps
        unit.gathered = True
        if unit.kind != "persistent":
            sp._free(unit)
    # Modules holding only frozen parameters or buffers; then frozen params and buffers: full, identical.
    materialize_modules(sp.device, by_module.get(-1, []), owners, init=sp.rank == 0, reader=reader)
    if reader is not None:
        reader.release()
    for name, buf in sp.root.named_buffers():
        if buf.is_meta:
            raise ConfigError(f"zero.stage=3: buffer {name!r} is still on the meta device after materialization; "
                              "create buffers on a real device in configure_model or compute them in "
                              "reset_parameters()")
    for t in list(sp.frozen) + list(sp.root.buffers()):
        if t.device != sp.device:
            t.data = t.data.to(sp.device)
        C.broadcast(t.data, src=group_src(sp), group=sp.group, tag="init")
    sp._register_hooks()
