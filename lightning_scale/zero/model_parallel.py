"""What a ZeRO engine of one dp x pp x tp grid rank agrees on beyond its dp group: the one cross-axis module.

A ZeRO engine shards the parameters it is given over its dp group and knows nothing else. Under tensor /
pipeline parallelism each rank's engine holds only its local tp slices of its own pipeline stage, so three
things must span the other axes too. Every engine (stages 0-3, offload; the Trainer strategy, the Fabric
strategy and plain scripts alike) takes one :class:`CrossAxis` and asks it:

* **Partial gradients first** (sequence parallelism; every parameter but the experts under ep): replicated LayerNorm
  weights and row-parallel biases hold per-tp-rank partial sums. At stages 0-2 the reducer adds them up over
  ``grad_group`` (the tp group's twin) bucket by bucket before each bucket's dp reduction, inside the backward
  (:mod:`lightning_scale.zero.reducer`); without a twin ``before_reduce`` (the tensor-parallel package's
  ``sync_tp_grads``) adds them up at the step, before the engine copies gradients into its buckets (such engines are
  built with ``overlap_comm=False``). At stage 3 the backward hooks have already reduce-scattered them
  over dp; both reductions are sums, so :meth:`CrossAxis.sum_partial` adds those shard elements over tp.
* **The global norm** (gradient clipping): every element of the model counts once. An element of this
  rank's master shard belongs to a tp-sharded parameter (each tp rank holds a different slice: count it),
  a tp-replicated one (count it on tp rank 0 only), or a parameter tied across pipeline stages (count it on
  its first holder only: ``exclude``). Squares are summed over dp (stage >= 1), then tp, then pp: the
  norm ``torch.nn.utils.clip_grad_norm_`` gives on the single-process model.
* **One overflow decision** (fp16 loss scaling): if any rank of the grid overflowed, every rank skips.

Which parameters are replicated or partial is the tensor-parallel package's knowledge; it is handed in as
predicates, so this module imports neither ``tensor_parallel`` nor ``pipeline``. ``CrossAxis()`` (no groups)
is the plain data-parallel case: nothing is masked and nothing extra is communicated.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_scale.comm import collectives as C

Predicate = Callable[[torch.Tensor], bool]


def _never(_: torch.Tensor) -> bool:
    return False


def shard_slice(state) -> slice:
    """This rank's ``[lo, hi)`` inside a bucket: stages 0-2 keep it as ``state.shard``, stage 3 as a range."""
    if isinstance(state.shard, slice):
        return state.shard
    lo, hi = state.bucket.shard_range(state.rank)
    return slice(lo, hi)


def norm_mask(bucket, shard: slice, tp_rank: int, replicated: Predicate = _never,
              exclude_ids=frozenset(), counted=None) -> Optional[torch.Tensor]:
    """Which elements of a bucket's shard ``[shard.start, shard.stop)`` count in the global norm.

    None when all do; else a bool mask over the shard: True for elements of tp-sharded parameters, of
    replicated ones only on tp rank 0, never for ``exclude_ids`` (tied copies) or padding. ``counted(param,
    tp_rank, shape)``: None, or a flat bool mask of the parameter's own elements that count (rows several tp
    ranks hold: kv heads < tp). Pure.
    """
    lo, hi = shard.start, shard.stop
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    for slot in bucket.slots:
        if id(slot.param) in exclude_ids or (tp_rank != 0 and replicated(slot.param)):
            continue
        a, b = slot.shard_overlap(lo, hi)  # offsets inside the parameter
        if b > a:
            keep = counted(slot.param, tp_rank, slot.shape) if counted is not None else None
            mask[slot.offset + a - lo:slot.offset + b - lo] = True if keep is None else keep[a:b]
    return None if bool(mask.all()) else mask


def partial_mask(bucket, shard: slice, partial: Predicate) -> Optional[torch.Tensor]:
    """Elements of a bucket's shard that belong to partial-gradient parameters (sequence parallel), or None."""
    lo, hi = shard.start, shard.stop
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    for slot in bucket.slots:
        if partial(slot.param):
            a, b = slot.shard_overlap(lo, hi)
            if b > a:
                mask[slot.offset + a - lo:slot.offset + b - lo] = True
    return mask if bool(mask.any()) else None


class CrossAxis:
    """The agreement over the tp and pp axes for the engines of one grid rank (see the module docstring).

    ``replicated(p)``: p is the same on every tp rank (counts once in the norm). ``partial(p)``: p's gradient
    is a per-tp-rank partial sum (sequence parallel). ``exclude``: parameters another rank counts in the
    norm (a tied embedding / head on its second pipeline holder). ``before_reduce``: called once per step
    before stage 0-2 engines read gradients (sums partial gradients over tp). ``grad_scale``: every reduced gradient
    is multiplied by it (``1 / ep`` when the tp axis carries expert parallelism: its ranks' losses are the means of
    different batches, so the sums over it must become a mean, as the dp reduction's are). ``grad_group``: a twin of
    the tp group for the partial sums inside the backward (None: summed at the step by ``before_reduce``).
    """

    def __init__(self, *, tp_group=None, pp_group=None, replicated: Predicate = _never, partial: Predicate = _never,
                 exclude: Iterable[torch.Tensor] = (), before_reduce: Optional[Callable[[], None]] = None,
                 counted=None, grad_scale: float = 1.0, grad_group=None) -> None:
        self.grad_scale = float(grad_scale)
        # the tp group's twin (same ranks) the stage 0-2 reducers sum partial gradients on during the backward
        self.grad_group = grad_group if grad_group is not None and C.group_size(grad_group) > 1 else None
        # None means "no such axis" here, not the default (world) group
        self.tp_group = tp_group if tp_group is not None and C.group_size(tp_group) > 1 else None
        self.pp_group = pp_group if pp_group is not None and C.group_size(pp_group) > 1 else None
        self.tp_rank = C.group_rank(self.tp_group) if self.tp_group is not None else 0
        self.replicated, self.partial, self.counted = replicated, partial, counted
        self.exclude_ids = frozenset(id(p) for p in exclude)
        self.before_reduce = before_reduce

    @property
    def groups(self) -> List:
        return [g for g in (self.tp_group, self.pp_group) if g is not None]

    # ------------------------------------------------------------------ built once per engine (pure)
    def masks(self, states: Sequence, masters: Sequence[torch.Tensor], stage: int
              ) -> Tuple[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]]]:
        """Per bucket state: the norm mask (None: every element counts) and, at stage 3 under sequence
        parallelism, the indices of partial-gradient elements in the shard (None: none)."""
        norms, partials = [], []
        for st, master in zip(states, masters):
            shard = shard_slice(st)
            m = norm_mask(st.bucket, shard, self.tp_rank, self.replicated, self.exclude_ids, self.counted)
            norms.append(None if m is None else m.to(master.device))
            pm = partial_mask(st.bucket, shard, self.partial) if stage == 3 and self.tp_group is not None else None
            partials.append(None if pm is None else pm.nonzero().flatten().to(master.device))
        return norms, partials

    # ------------------------------------------------------------------ per step
    @staticmethod
    def local_sq_norm(masters: Sequence[torch.Tensor], masks: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        """Sum of squares of this rank's counted master-gradient elements (float64), before any all-reduce."""
        total = torch.zeros((), dtype=torch.float64, device=masters[0].device)
        for m, mask in zip(masters, masks):
            g = m.grad.double()
            if mask is not None:
                g = torch.where(mask, g, torch.zeros((), dtype=g.dtype, device=g.device))
            total += torch.dot(g.reshape(-1), g.reshape(-1))
        return total

    def all_reduce_sq(self, sq: torch.Tensor, dp_group, stage: int) -> torch.Tensor:
        """Squared norm summed over dp (stage >= 1: each dp rank holds a different shard), then tp, then pp."""
        if stage >= 1:
            C.all_reduce(sq, dp_group, tag="grad_norm")
        for g in self.groups:
            C.all_reduce(sq, g, tag="grad_norm")
        return sq

    def agree_overflow(self, found_inf: bool, device: torch.device) -> bool:
        """Every grid rank's overflow flag (each already agreed over its dp group) -> one decision."""
        if not self.groups:
            return found_inf
        flag = torch.tensor(float(found_inf), dtype=torch.float32, device=device)
        for g in self.groups:
            C.all_reduce(flag, g, op=dist.ReduceOp.MAX, tag="overflow")
        return bool(flag.item() > 0)

    @torch.no_grad()
    def sum_partial(self, masters: Sequence[torch.Tensor], partials: Sequence[Optional[torch.Tensor]]) -> None:
        """Stage 3, sequence parallel: add the partial-gradient elements of the reduced shards over tp. Every tp
        rank holds the same unit layout, so they sit at the same shard offsets: one flat all-reduce."""
        picked = [(m, idx) for m, idx in zip(masters, partials) if idx is not None]
        if self.tp_group is None or not picked:
            return
        flat = torch.cat([m.grad[idx] for m, idx in picked])
        C.all_reduce(flat, self.tp_group, tag="tp/partial_grads")
        offset = 0
        for m, idx in picked:
            m.grad[idx] = flat[offset:offset + idx.numel()]
            offset += idx.numel()


NO_CROSS_AXIS = CrossAxis()
