"""What a ZeRO engine (stages 0-3, offload, under tp / pp) holds, as layout-free :class:`~.layout.Piece` objects.

:class:`~lightning_scale.zero.optimizer.ShardEngine` (``ZeroOptimizer`` and ``Stage3Optimizer``) delegates here.
Every engine keeps per bucket state ``st``: the bucket's slots (param, offset, numel, shape), this rank's range
``[lo, hi)`` of the bucket (``model_parallel.shard_slice``), the parameter shard (stages 0-2: a slice of the full
``param_buffer``; stage 3: ``st.shard``), the master shard (fp32 under mixed precision, else an alias of the
parameter shard) and the inner optimizer's state for that master. A slot overlapping ``[lo, hi)`` becomes one
:func:`flat_param_piece` per key (views of the shard tensors: saving reads them, loading writes them in place):

- ``model/<fqn>`` (parameter shard, training dtype), ``master/<fqn>`` (only where the master is a separate copy),
- ``optim/<fqn>/<state>`` for every state tensor shaped like the master (``exp_avg``, ``exp_avg_sq``, ...) and
  every 0-d state (``step``: one value per bucket, yielded for each of its fqns - replicated, written once).

tp slices are mapped back through the parameter's ``ShardSpec`` (``tp_spec``): a slice at ``tp_rank * local``
along ``spec.dim`` of the padded global shape, the true (unpadded) size stored; fused sections (a qkv weight
split per section) are cut into one sub-range per section. At stage 0 every dp rank holds the whole bucket and
yields the same chunks: DCP's plan dedup writes them once.

Loading reads the trainable weights into the *masters* only (``weights_from="master"`` when the checkpoint kept
fp32 masters, ``"model"`` when it did not, e.g. it was 32-true), then :func:`after_load_` writes the masters into
the parameters exactly as a step does (cast, all-gather at stages 1-2, the persistent units at stage 3): the
resumed parameters are bit-for-bit what the saving run's step wrote.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Dict, Iterator, Mapping, Optional, Sequence, Set

import torch

from lightning_scale.checkpoint.folder import CheckpointError
from lightning_scale.checkpoint.layout import (Piece, TPSlice, flat_piece, master_key, model_key, optim_key,
                                              tensor_piece)

WEIGHT_SOURCES = ("model", "master")


def _tp_spec(t: torch.Tensor):
    return getattr(t, "tp_spec", None)  # tensor_parallel.sharding.tp_spec, without importing the package


def flat_param_piece(key: str, flat: torch.Tensor, local_shape: Sequence[int], start: int, spec=None,
                     tp_rank: int = 0) -> Piece:
    """``flat`` = elements ``[start, start + len)`` of a local tensor of ``local_shape`` (row-major), which is the
    whole tensor (``spec=None``) or this tp rank's slice described by a ``ShardSpec``."""
    local = tuple(int(s) for s in local_shape)
    if spec is None:
        return flat_piece(key, flat, local, start)
    padded = list(local)
    padded[spec.dim] = spec.padded
    true = list(local)
    true[spec.dim] = spec.size
    if spec.sections == 1:
        return flat_piece(key, flat, local, start, tp=TPSlice(spec.dim, tp_rank * spec.local_size),
                          global_shape=padded, true_shape=true)
    if spec.dim != 0:
        raise NotImplementedError(f"{key}: a fused tensor-parallel parameter split along dim {spec.dim} "
                                  "(only dim 0 sections are mapped to the layout-free checkpoint)")
    # Section k of the local rows [k*sl, (k+1)*sl) is global rows k*(size/sections) + tp_rank*sl + [0, sl).
    sl, inner = spec.section_local, math.prod(local[1:])
    merged = Piece(key, tuple(true), flat.dtype)
    end = start + flat.numel()
    for k in range(spec.sections):
        lo, hi = k * sl * inner, (k + 1) * sl * inner
        a, b = max(lo, start), min(hi, end)
        if a >= b:
            continue
        sub = flat_piece(key, flat[a - start:b - start], (sl,) + local[1:], a - lo,
                         tp=TPSlice(0, k * (spec.size // spec.sections) + tp_rank * sl), global_shape=true)
        merged.chunks += sub.chunks
        merged.tensors += sub.tensors
    return merged


def tensor_pieces(key: str, t: torch.Tensor, tp_rank: int = 0) -> Piece:
    """A whole local tensor (a buffer, a frozen parameter), tp-mapped when it carries a ``ShardSpec``."""
    flat = t.detach().reshape(-1)
    if t.numel() and flat.data_ptr() != t.data_ptr():  # reshape copied: write into the real tensor instead
        raise ValueError(f"{key}: a non-contiguous tensor cannot be checkpointed in place")
    return flat_param_piece(key, flat, tuple(t.shape), 0, _tp_spec(t), tp_rank)


def _param_shard(engine, st) -> torch.Tensor:
    return st.shard if engine.stage == 3 else st.param_buffer[st.shard]


def _bounds(st):
    from lightning_scale.zero.model_parallel import shard_slice

    sl = shard_slice(st)
    return sl.start, sl.stop


def engine_pieces(engine, names: Mapping[int, str], weights_from: Optional[str] = None) -> Iterator[Piece]:
    """The pieces of ``engine`` (a ShardEngine), keyed by ``names`` (id(param) -> fqn in the unsplit model).

    ``weights_from=None``: what a save writes. ``"master"`` / ``"model"``: what a load fills - the weights go into
    the master shards from that key (no ``model/`` piece for a trainable parameter), the optimizer state as saved.
    """
    if weights_from not in (None,) + WEIGHT_SOURCES:
        raise ValueError(f"weights_from={weights_from!r}: one of None, {WEIGHT_SOURCES}")
    tp_rank = engine.cross.tp_rank
    for st, master, aliased in zip(engine.reducer.states, engine.masters, engine._aliased):
        lo, hi = _bounds(st)
        param_shard = _param_shard(engine, st)
        state = engine.inner.state.get(master, {})
        for slot in st.bucket.slots:
            a, b = slot.shard_overlap(lo, hi)
            if a >= b:
                continue
            fqn = _name(names, slot.param)
            off, n, spec = slot.offset + a - lo, b - a, _tp_spec(slot.param)
            # the slot's elements [a, b) sit at [off, off + n) of every shard-sized tensor of this bucket
            piece = functools.partial(_slot_piece, off=off, n=n, shape=slot.shape, start=a, spec=spec,
                                      tp_rank=tp_rank)
            if weights_from is None:
                yield piece(model_key(fqn), param_shard)
                if not aliased:
                    yield piece(master_key(fqn), master)
            else:
                yield piece(f"{weights_from}/{fqn}", master)
            for sname, value in state.items():
                if not torch.is_tensor(value):
                    continue
                if value.shape == master.shape:
                    yield piece(optim_key(fqn, sname), value)
                elif value.dim() == 0:
                    yield tensor_piece(optim_key(fqn, sname), value)


def _slot_piece(key: str, shard: torch.Tensor, *, off: int, n: int, shape, start: int, spec, tp_rank: int) -> Piece:
    return flat_param_piece(key, shard[off:off + n], shape, start, spec, tp_rank)


def _name(names: Mapping[int, str], param: torch.Tensor) -> str:
    try:
        return names[id(param)]
    except KeyError:
        raise KeyError(f"a parameter of shape {tuple(param.shape)} is not in the names map handed to "
                       "named_pieces (id(param) -> fqn of the module being checkpointed)") from None


def engine_fqns(engine, names: Mapping[int, str]) -> Set[str]:
    return {_name(names, slot.param) for st in engine.reducer.states for slot in st.bucket.slots}


@torch.no_grad()
def allocate_state_(engine, states: Mapping[str, "tuple[torch.dtype, bool]"]) -> None:
    """Create the optimizer state a load will fill, where the optimizer allocates it lazily (Adam's ``exp_avg``,
    ``exp_avg_sq``, ``step`` at the first step). ``states``: state name -> (dtype, is_scalar) as the checkpoint
    holds them. Masters whose state already exists are left alone."""
    group_of = {id(p): g for g in engine.inner.param_groups for p in g["params"]}
    for master in engine.masters:
        if engine.inner.state.get(master):
            continue
        group = group_of[id(master)]
        on_device = bool(group.get("fused") or group.get("capturable"))  # torch keeps `step` on the host otherwise
        slot: Dict[str, torch.Tensor] = {}
        for sname, (dtype, scalar) in states.items():
            if scalar:
                slot[sname] = torch.zeros((), dtype=dtype, device=master.device if on_device else "cpu")
            else:
                slot[sname] = torch.zeros_like(master)
        if slot:
            engine.inner.state[master] = slot


@torch.no_grad()
def after_load_(engine, missing: Sequence[str], names: Mapping[int, str]) -> None:
    """The masters were loaded: write them into the parameters as a step does; warn for missing state."""
    engine._write_back_and_gather()
    mine = engine_fqns(engine, names)
    gone = sorted({k.split("/", 2)[1] for k in missing if k.startswith("optim/") and k.split("/", 2)[1] in mine})
    if gone:
        warnings.warn(f"the checkpoint has no optimizer state for {len(gone)} parameter(s) {gone[:3]}"
                      f"{' ...' if len(gone) > 3 else ''}: they resume with fresh (zero) optimizer state")
    weights = [k for k in missing if k.split("/", 1)[0] in WEIGHT_SOURCES and k.split("/", 1)[1] in mine]
    if weights:
        raise CheckpointError(f"the checkpoint has no weights for {weights[:3]} ({len(weights)} missing)")
