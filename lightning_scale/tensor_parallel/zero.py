"""Tensor parallelism x ZeRO stages 1 / 2: each rank's local tp slices sharded over its dp group.

Layout (``Topology(dp, tp)``): ``apply_tensor_parallel`` splits the model over the tp group; then each
rank wraps an optimizer over its *local* parameters (tp slices and replicated ones) in a
:class:`lightning_scale.zero.ZeroOptimizer` over the dp group. The engine only knows dp, so three
things do not follow from running the two pieces side by side, and this module supplies them:

* **Partial gradients first.** With sequence parallelism, replicated LayerNorm weights and
  row-parallel biases hold per-tp-rank partial sums that :func:`sync_tp_grads` must add up *before*
  the engine copies them into its buckets. The engine's backward hooks would consume (and, at
  ZeRO-2, free) them earlier, so such engines must be built with ``overlap_comm=False``;
  :func:`reduce_gradients_tp` checks that, syncs, then reduces.
* **The global norm.** An element of an engine's master shard belongs to a tp-sharded parameter
  (each tp rank holds a different slice: count it) or a replicated one (every tp rank holds the same
  value: count it on tp rank 0 only). The per-bucket 0/1 weights are built once from the bucket
  slots and the shard range; squared norms are summed over dp, then over tp.
* **One overflow decision.** Under fp16 loss scaling the engines agree over dp only; a tp peer that
  steps while another skips would desynchronize replicated parameters, so the flag is agreed over tp
  in the same all-reduce as the norm.

Engines are duck-typed (``reduce_gradients``, ``reducer.states``, ``masters``, ``stage``, ``group``),
so this module does not import :mod:`lightning_scale.zero`.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError
from lightning_scale.tensor_parallel.grads import sync_tp_grads
from lightning_scale.tensor_parallel.sharding import tp_partial_grad, tp_replicated
from lightning_scale.tensor_parallel.state import tensor_parallel_state

# engine -> (tp rank, per-bucket weights); built on first use, dropped with the engine.
_WEIGHTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _as_list(engines) -> List:
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    if not engines:
        raise ValueError("engines: pass at least one ZeroOptimizer (one per optimizer of this rank)")
    return engines


def shard_norm_weights(bucket, shard: slice, tp_rank: int) -> Optional[torch.Tensor]:
    """Which elements of a bucket's shard ``[shard.start, shard.stop)`` count in the global norm.

    Returns None when all of them do (no masking needed), else a bool mask over the shard: True for
    elements of tp-sharded parameters, and of replicated ones only on tp rank 0. Padding is False
    (its gradient is zero anyway). Pure: no communication.
    """
    lo, hi = shard.start, shard.stop
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    for slot in bucket.slots:
        if tp_replicated(slot.param) and tp_rank != 0:
            continue
        a, b = slot.shard_overlap(lo, hi)  # offsets inside the parameter
        if b > a:
            mask[slot.offset + a - lo:slot.offset + b - lo] = True
    if bool(mask.all()):
        return None
    return mask


def _weights(engine, tp_rank: int) -> List[Optional[torch.Tensor]]:
    cached = _WEIGHTS.get(engine)
    if cached is None or cached[0] != tp_rank:
        device = engine.masters[0].device
        weights = []
        for st in engine.reducer.states:
            w = shard_norm_weights(st.bucket, st.shard, tp_rank)
            weights.append(None if w is None else w.to(device))
        cached = (tp_rank, weights)
        _WEIGHTS[engine] = cached
    return cached[1]


def check_zero_tp(model: nn.Module, engines) -> None:
    """Reject engines that would reduce gradients before :func:`sync_tp_grads` ran (sequence parallel).

    Raises ``ConfigError`` naming ``overlap_comm`` when the model has partial-gradient parameters and
    an engine reduces buckets from its backward hooks.
    """
    state = tensor_parallel_state(model)
    partial = state.partial_grad_params(model) if state is not None else [p for p in model.parameters()
                                                                           if tp_partial_grad(p)]
    if not partial:
        return
    for e in _as_list(engines):
        if getattr(e.reducer, "overlap_comm", False):
            raise ConfigError(
                "zero.overlap_comm=True with tensor_parallel.sequence_parallel=True: the engine would reduce "
                f"{len(partial)} partial LayerNorm / bias gradients before sync_tp_grads adds them over tp; "
                "build the ZeroOptimizer with overlap_comm=False"
            )


def reduce_gradients_tp(model: nn.Module, engines) -> None:
    """After the last backward of the step: sum partial gradients over tp, then reduce each engine over dp."""
    engines = _as_list(engines)
    check_zero_tp(model, engines)
    sync_tp_grads(model)
    for e in engines:
        e.reduce_gradients()


def _agree(engines: Sequence, tp_group) -> Tuple[torch.Tensor, bool]:
    """[squared norm, overflow flag] summed over each engine's dp group, then over tp (float64)."""
    tp_rank = C.group_rank(tp_group)
    device = engines[0].masters[0].device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for e in engines:
        found = bool(e.reduce_gradients())
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        for master, w in zip(e.masters, _weights(e, tp_rank)):
            g = master.grad.double()
            if w is not None:
                g = torch.where(w, g, torch.zeros((), dtype=g.dtype, device=g.device))
            acc[0] += torch.dot(g, g)
        acc[1] = float(found)
        if e.stage >= 1:  # stage 0: every dp rank holds the whole reduced gradient already
            C.all_reduce(acc, e.group, tag="grad_norm")
        total += acc
    if C.group_size(tp_group) > 1:
        C.all_reduce(total, tp_group, tag="tp/grad_norm")
    found_inf = bool(total[1].item() > 0)
    if found_inf:
        for e in engines:
            e.mark_overflow()  # step() then skips and backs the loss scale off, like a local overflow
    return total, found_inf


@torch.no_grad()
def grad_norm_zero_tp(engines, tp_group) -> torch.Tensor:
    """L2 norm of the whole model's reduced gradient over dp x tp (float64), equal on every rank.

    Collective over each engine's dp group and over ``tp_group``. Replicated parameters count once.
    Also agrees the fp16 overflow flag over tp: if any rank overflowed, every engine skips its step.
    """
    total, _ = _agree(_as_list(engines), tp_group)
    return total[0].sqrt()


@torch.no_grad()
def clip_grad_norm_zero_tp(engines, max_norm: float, tp_group) -> torch.Tensor:
    """Clip every engine's master gradients by the global dp x tp norm, exactly like
    ``torch.nn.utils.clip_grad_norm_`` on the single-process model (coefficient
    ``max_norm / (norm + 1e-6)``, at most 1). Returns the norm before clipping.

    If any rank of the dp x tp grid overflowed (fp16 loss scaling), nothing is scaled and every engine
    is marked to skip its step.
    """
    if not max_norm > 0:
        raise ValueError(f"gradient_clip_val={max_norm!r}: the max norm must be positive")
    engines = _as_list(engines)
    total, found_inf = _agree(engines, tp_group)
    norm = total[0].sqrt()
    if found_inf:
        return norm
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for e in engines:
        for m in e.masters:
            m.grad.mul_(coef.to(m.grad.dtype))
    return norm
