"""Gradient bookkeeping for tensor parallelism: partial-gradient sync and the global grad norm.

Two facts the optimizer side must respect:

* With sequence parallelism, replicated parameters used on sequence-sharded activations (LayerNorm,
  row-parallel biases) get only this rank's tokens' contribution. :func:`sync_tp_grads` sums them over
  the tp group in one flat all-reduce; call it once per optimizer step, after the last backward and
  before gradient reduction over dp, clipping or the step (Megatron's "finalize grads").
* A replicated parameter inside a tp region (``replicated_with_grad_allreduce``: Qwen3 / Gemma3 per-head
  q/k norms after a column-parallel projection) sees only this rank's heads, so its gradient is a partial
  sum. :func:`install_grad_allreduce` makes the module read the parameter through ``copy_to_region``: the
  all-reduce runs in the backward, on each micro-batch's contribution, before anything accumulates it
  (gradient accumulation, ZeRO buckets reducing during the backward, stage-3 shards, clipping all see the
  complete gradient; nothing to call afterwards, unlike the partial marks above).
* A replicated parameter (``tp_replicated(p)``) has the same gradient on every tp rank. A global norm
  over dp x tp must count it once, not tp times; :func:`grad_norm` does, and a ZeRO engine that
  flattens parameters can weight each element with ``tp_replicated`` the same way. Rows of replicated kv
  pieces (kv heads < tp, ``ShardSpec.splits``) count on the first rank holding each (``tp_counted_mask``).
"""

from __future__ import annotations

import math
from typing import Iterable, List, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_scale.comm import collectives
from lightning_scale.tensor_parallel.mappings import copy_to_region
from lightning_scale.tensor_parallel.sharding import tp_counted_mask, tp_partial_grad, tp_replicated
from lightning_scale.tensor_parallel.state import tensor_parallel_state

Params = Union[nn.Module, Iterable[torch.Tensor]]


def _params(params: Params) -> List[torch.Tensor]:
    return list(params.parameters()) if isinstance(params, nn.Module) else list(params)


def _tp_group(params: Params, group):
    if group is not None or not isinstance(params, nn.Module):
        return group
    state = tensor_parallel_state(params)
    return None if state is None else state.group


def install_grad_allreduce(module: nn.Module, group, tag: str) -> list:
    """``module``'s own parameters enter its forward through ``copy_to_region`` (identity forward, gradient
    all-reduced over ``group`` backward). Returns the hook handles. The parameters stay the module's
    ``Parameter`` objects (state_dict, optimizers, ZeRO's ``.data`` swaps untouched): only while the forward
    runs does ``module._parameters`` hold the region-entering views."""
    def enter(mod, args):
        if not torch.is_grad_enabled():
            return
        saved = {n: p for n, p in mod._parameters.items() if p is not None and p.requires_grad}
        for n, p in saved.items():
            mod._parameters[n] = copy_to_region(p, group, tag=tag)  # (same shape) non-leaf view of p
        mod.__dict__["_tp_region_saved"] = saved

    def leave(mod, args, output):
        saved = mod.__dict__.pop("_tp_region_saved", None)
        if saved:
            mod._parameters.update(saved)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]


@torch.no_grad()
def sync_tp_grads(params: Params, group=None) -> int:
    """All-reduce (sum) over the tp group the gradients of parameters marked as partial.

    ``params``: the model (its tp group is used when ``group`` is None) or parameters. Returns the number
    of elements reduced (0: nothing to do, e.g. no sequence parallelism).
    """
    group = _tp_group(params, group)
    state = tensor_parallel_state(params) if isinstance(params, nn.Module) else None
    candidates = state.partial_grad_params(params) if state is not None else _params(params)
    todo = [p for p in candidates if tp_partial_grad(p) and p.grad is not None]
    total = 0
    for dtype in sorted({p.grad.dtype for p in todo}, key=str):
        grads = [p.grad for p in todo if p.grad.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        collectives.all_reduce(flat, group, tag="tp/partial_grads")
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        total += flat.numel()
    return total


@torch.no_grad()
def grad_norm(params: Params, tp_group=None, dp_group=None, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients of the model split over tp (and optionally dp).

    ``tp_group``: the tp group (defaults to the model's). Replicated parameters count once.
    ``dp_group``: pass it only when each dp rank holds a *different* part of the gradients (ZeRO-2/3
    shards); leave None when gradients are the same on every dp rank (after a plain all-reduce).
    """
    tp_group = _tp_group(params, tp_group)
    grads = [(p.grad, tp_replicated(p)) for p in _params(params) if p.grad is not None]
    tp_group_rank = collectives.group_rank(tp_group)
    dtype = torch.float64 if any(g.dtype == torch.float64 for g, _ in grads) else torch.float32
    device = grads[0][0].device if grads else torch.device("cpu")
    # Replicated gradients: only tp rank 0 contributes them, so the all-reduce counts them once; rows of
    # replicated kv pieces (kv heads < tp) only on the first rank holding each.
    mine = []
    for p in _params(params):
        if p.grad is None or (tp_replicated(p) and tp_group_rank != 0):
            continue
        keep = tp_counted_mask(p, tp_group_rank)
        mine.append(p.grad if keep is None else p.grad.reshape(-1)[keep.to(p.grad.device)])
    if norm_type == math.inf:
        local = torch.stack([g.detach().abs().max().to(dtype) for g in mine]).max() if mine else None
        acc = torch.zeros(1, dtype=dtype, device=device) if local is None else local.reshape(1).clone()
        op = dist.ReduceOp.MAX
    else:
        acc = torch.zeros(1, dtype=dtype, device=device)
        for g in mine:
            acc += torch.linalg.vector_norm(g.detach().to(dtype), norm_type) ** norm_type
        op = dist.ReduceOp.SUM
    collectives.all_reduce(acc, tp_group, op=op, tag="tp/grad_norm")
    if dp_group is not None:
        collectives.all_reduce(acc, dp_group, op=op, tag="tp/grad_norm")
    return acc[0] if norm_type == math.inf else acc[0] ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(params: Params, max_norm: float, tp_group=None, dp_group=None,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm (see :func:`grad_norm`) is at most ``max_norm``; returns the norm."""
    total = grad_norm(params, tp_group, dp_group, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in _params(params):
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total
