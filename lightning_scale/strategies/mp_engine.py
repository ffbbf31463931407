"""A ZeRO engine for one rank of a dp x pp x tp grid: ZeRO over dp, norm and overflow over all three axes.

:class:`~lightning_scale.zero.ZeroOptimizer` shards the parameters it is given over its dp group and
knows nothing else. Under tensor / pipeline parallelism each rank's engine holds only its local tp
slices of its own pipeline stage, so three things must span the other axes too:

* **Partial gradients first** (sequence parallelism): replicated LayerNorm weights and row-parallel
  biases hold per-tp-rank partial sums; :func:`sync_tp_grads` adds them up before the engine copies
  gradients into its buckets (the strategy builds such engines with ``overlap_comm=False``).
* **The global norm** (gradient clipping): every element of this rank's master shard counts once in
  the whole model's norm: tp-sharded elements on every tp rank, replicated ones on tp rank 0 only,
  a parameter tied across pipeline stages (embedding / LM head) on its first holder only. Squares are
  summed over dp (stage >= 1), then tp, then pp: the norm ``torch.nn.utils.clip_grad_norm_`` gives
  on the single-process model.
* **One overflow decision** (fp16 loss scaling): if any rank of the grid overflowed, every rank skips.

At ZeRO-3 (tp only) the same agreement wraps :class:`Stage3Optimizer`; its backward hooks reduce-scatter every
unit over dp during backward, so sequence parallel's partial sums are added over tp afterwards, on the reduced
shards (both reductions are sums, so the order does not matter).

Used by ``Zero3DStrategy`` when ``tp > 1`` or ``pp > 1``; at ``tp == pp == 1`` the plain engine runs.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_scale.comm import collectives as C
from lightning_scale.tensor_parallel import sync_tp_grads, tp_replicated
from lightning_scale.tensor_parallel.sharding import tp_partial_grad
from lightning_scale.tensor_parallel.state import tensor_parallel_state
from lightning_scale.zero import ZeroOptimizer
from lightning_scale.zero.stage3_optimizer import Stage3Optimizer
from lightning_scale.zero.precision import NoLossScaler


def norm_mask(bucket, shard: slice, tp_rank: int, exclude_ids=frozenset()) -> Optional[torch.Tensor]:
    """Which elements of a bucket's shard ``[shard.start, shard.stop)`` count in the global norm.

    None when all do; else a bool mask over the shard. Pure: no communication.
    """
    lo, hi = shard.start, shard.stop
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    for slot in bucket.slots:
        if id(slot.param) in exclude_ids or (tp_rank != 0 and tp_replicated(slot.param)):
            continue
        a, b = slot.shard_overlap(lo, hi)  # offsets inside the parameter
        if b > a:
            mask[slot.offset + a - lo:slot.offset + b - lo] = True
    return None if bool(mask.all()) else mask


def _shard_slice(state) -> slice:
    """This rank's ``[lo, hi)`` inside a bucket: stages 1/2 keep it as ``state.shard``, stage 3 as a range."""
    if isinstance(state.shard, slice):
        return state.shard
    lo, hi = state.bucket.shard_range(state.rank)
    return slice(lo, hi)


def partial_mask(bucket, shard: slice) -> Optional[torch.Tensor]:
    """Elements of a bucket's shard that belong to partial-gradient parameters (sequence parallel), or None."""
    lo, hi = shard.start, shard.stop
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    for slot in bucket.slots:
        if tp_partial_grad(slot.param):
            a, b = slot.shard_overlap(lo, hi)
            if b > a:
                mask[slot.offset + a - lo:slot.offset + b - lo] = True
    return mask if bool(mask.any()) else None


class _ModelParallelMixin:
    """Norm, clipping and overflow over dp x pp x tp for a ZeRO engine (stages 1/2 or 3) of one grid rank."""

    def _init_model_parallel(self, tp_group, pp_group, model, norm_exclude) -> None:
        self.tp_group, self.pp_group, self.model = tp_group, pp_group, model
        tp_rank = C.group_rank(tp_group) if tp_group is not None and C.group_size(tp_group) > 1 else 0
        exclude = frozenset(id(p) for p in norm_exclude)
        self._keep_grads_once = False
        self._masks: List[Optional[torch.Tensor]] = []
        self._partial: List[Optional[torch.Tensor]] = []
        state = tensor_parallel_state(model) if model is not None else None
        if state is not None:
            state.partial_grad_params(model)  # (re)marks them on the current parameter objects
        for st, master in zip(self.reducer.states, self.masters):
            shard = _shard_slice(st)
            m = norm_mask(st.bucket, shard, tp_rank, exclude)
            self._masks.append(None if m is None else m.to(master.device))
            pm = partial_mask(st.bucket, shard) if self.stage == 3 else None
            self._partial.append(None if pm is None else pm.nonzero().flatten().to(master.device))

    def keep_gradients_once(self) -> None:
        """Ignore the next ``zero_grad()``. Lightning's closure zeroes gradients *after* ``training_step`` and
        before ``backward``; a pipeline schedule computes them inside ``training_step``, so the strategy zeroes
        them before the schedule and has that one call skipped."""
        self._keep_grads_once = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._keep_grads_once:
            self._keep_grads_once = False
            return
        super().zero_grad(set_to_none)

    def _other_axes(self) -> List:
        # None means "no such axis" here, not the default (world) group
        return [g for g in (self.tp_group, self.pp_group) if g is not None and C.group_size(g) > 1]

    def reduce_gradients(self) -> bool:
        if self._prepared:
            return self._found_inf
        if self.model is not None and self.stage < 3:
            sync_tp_grads(self.model)  # sequence parallel: partial sums over tp, before the buckets read them
        found = super().reduce_gradients()
        if self.stage == 3:
            self._sum_partial_shards()
        if not isinstance(self.loss_scaler, NoLossScaler):
            flag = torch.tensor(float(found), dtype=torch.float32, device=self.masters[0].device)
            for g in self._other_axes():
                C.all_reduce(flag, g, op=dist.ReduceOp.MAX, tag="overflow")
            self._found_inf = bool(flag.item() > 0)
        return self._found_inf

    @torch.no_grad()
    def _sum_partial_shards(self) -> None:
        """Stage 3, sequence parallel: the backward hooks already reduce-scattered each unit's gradients over
        dp, partial LayerNorm / bias sums included; both reductions are sums, so adding those shard elements
        over tp now gives what sync_tp_grads-then-reduce gives. Every tp rank holds the same unit layout, so
        the elements sit at the same shard offsets: one flat all-reduce of them."""
        if self.tp_group is None or C.group_size(self.tp_group) <= 1:
            return
        picked = [(m, idx) for m, idx in zip(self.masters, self._partial) if idx is not None]
        if not picked:
            return
        flat = torch.cat([m.grad[idx] for m, idx in picked])
        C.all_reduce(flat, self.tp_group, tag="tp/partial_grads")
        offset = 0
        for m, idx in picked:
            m.grad[idx] = flat[offset:offset + idx.numel()]
            offset += idx.numel()

    def _local_sq_norm(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.masters[0].device)
        for m, mask in zip(self.masters, self._masks):
            g = m.grad.double()
            if mask is not None:
                g = torch.where(mask, g, torch.zeros((), dtype=g.dtype, device=g.device))
            total += torch.dot(g, g)
        return total

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's reduced, unscaled gradient over dp x pp x tp (float64)."""
        self.reduce_gradients()
        sq = self._local_sq_norm()
        if self.stage >= 1:
            C.all_reduce(sq, self.group, tag="grad_norm")
        for g in self._other_axes():
            C.all_reduce(sq, g, tag="grad_norm")
        return sq.sqrt()


class ModelParallelZeroOptimizer(_ModelParallelMixin, ZeroOptimizer):
    """``ZeroOptimizer`` over ``group`` (dp) whose gradient norm and overflow flag span ``tp_group`` and
    ``pp_group`` too. ``model``: the tp-split module (its partial gradients are summed before reduction);
    ``norm_exclude``: parameters another pipeline rank counts in the norm (tied copies)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, tp_group=None, pp_group=None,
                 model: Optional[nn.Module] = None, norm_exclude: Iterable[torch.Tensor] = (), **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        self._init_model_parallel(tp_group, pp_group, model, norm_exclude)


class ModelParallelStage3Optimizer(_ModelParallelMixin, Stage3Optimizer):
    """:class:`~lightning_scale.zero.stage3_optimizer.Stage3Optimizer` (ZeRO-3 over dp of this rank's tp
    slices) with the same norm / overflow agreement over tp, and sequence parallel's partial gradients summed
    over tp on the reduced shards."""

    def __init__(self, optimizer: torch.optim.Optimizer, sharded, *, tp_group=None, pp_group=None,
                 model: Optional[nn.Module] = None, norm_exclude: Iterable[torch.Tensor] = (), **kwargs) -> None:
        super().__init__(optimizer, sharded, **kwargs)
        self._init_model_parallel(tp_group, pp_group, model, norm_exclude)
