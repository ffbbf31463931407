"""Pipeline x data parallelism with ZeRO stage 1 / 2: each stage's parameters sharded over its dp group.

Layout (``Topology(dp, pp)``): the ranks of one pipeline stage form a dp group; each wraps its
stage's optimizer in a :class:`lightning_scale.zero.ZeroOptimizer` over that group. Three things
do not follow from running the two pieces side by side, and this module supplies them:

* **Reduce once per optimizer step.** The runtime runs every micro-batch's backward inside one
  ``train_step``; the engines' gradient hooks would reduce (and, at ZeRO-2, free) gradients after
  the first micro-batch. :meth:`ZeroPipeline.train_step` runs the schedule inside every engine's
  ``no_sync()``, so gradients accumulate locally and are reduce-scattered once, in ``step``.
  This holds whatever the engines' ``overlap_comm`` (DeepSpeed forbids ZeRO-2 with pipelines
  for exactly this reason).
* **Clipping by the global norm.** An engine only knows its dp group, i.e. its own stage. The
  norm of the whole model sums the squared norms of every stage: :func:`clip_grad_norm_across_stages`
  sums each engine's shard over dp, then over pp, and counts a tied parameter (embedding / head on
  the first and last stage, which both hold the same summed gradient) once.
* **One overflow decision.** Under fp16 loss scaling, a stage that skips its step while another
  applies its update would leave the model inconsistent: :func:`agree_overflow_across_stages`
  makes every stage skip when any stage overflowed.

Engines are duck-typed (``reduce_gradients``, ``no_sync``, ``masters``, ``stage``, ``group``...), so
this module does not import :mod:`lightning_scale.zero`.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError


def _as_list(engines) -> List:
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    if not engines:
        raise ValueError("engines: pass at least one ZeroOptimizer (one per optimizer of this pipeline stage)")
    return engines


def agree_overflow_across_stages(engines: Sequence, pp_group) -> bool:
    """Finish each engine's gradient reduction; if any stage found inf/nan, every stage skips its step.

    Collective over ``pp_group`` (each engine has already agreed over its dp group). Returns the
    agreed ``found_inf``.
    """
    engines = _as_list(engines)
    found = any(bool(e.reduce_gradients()) for e in engines)
    if C.group_size(pp_group) > 1:
        flag = torch.tensor(float(found), dtype=torch.float64, device=engines[0].masters[0].device)
        C.all_reduce(flag, pp_group, op=dist.ReduceOp.MAX, tag="overflow")
        found = bool(flag.item() > 0)
    if found:
        for e in engines:
            e.mark_overflow()  # step() then skips and backs the loss scale off, like a local overflow
    return found


def _sq_norm_of(engine, params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Squared norm of the parts of ``params``' reduced gradients that lie in this rank's shard."""
    wanted = {id(p) for p in params}
    total = torch.zeros((), dtype=torch.float64, device=engine.masters[0].device)
    if not wanted:
        return total
    for st, master in zip(engine.reducer.states, engine.masters):
        lo, hi = st.shard.start, st.shard.stop  # master.grad covers bucket elements [lo, hi)
        for slot in st.bucket.slots:
            if id(slot.param) not in wanted:
                continue
            a, b = slot.shard_overlap(lo, hi)  # offsets inside the parameter
            if b > a:
                part = master.grad[slot.offset + a - lo:slot.offset + b - lo]
                total += part.double().pow(2).sum()
    return total


def grad_sq_norm_across_stages(engines: Sequence, pp_group,
                               exclude: Iterable[torch.nn.Parameter] = ()) -> torch.Tensor:
    """Squared L2 norm of the whole model's reduced gradient (float64), equal on every rank.

    Per engine: this rank's shard, minus the parameters in ``exclude`` (the tied copies that
    another stage counts), summed over the engine's dp group (stage >= 1; at stage 0 every dp rank
    holds the full reduced gradient); then summed over ``pp_group``.
    """
    engines = _as_list(engines)
    exclude = list(exclude)
    total = torch.zeros((), dtype=torch.float64, device=engines[0].masters[0].device)
    for e in engines:
        e.reduce_gradients()
        # TODO(zero): _local_sq_norm is private; see the request for a public local_grad_sq_norm().
        sq = e._local_sq_norm() - _sq_norm_of(e, exclude)
        if e.stage >= 1:
            C.all_reduce(sq, e.group, tag="grad_norm")
        total += sq
    if C.group_size(pp_group) > 1:
        C.all_reduce(total, pp_group, tag="grad_norm")
    return total


def clip_grad_norm_across_stages(engines: Sequence, max_norm: float, pp_group,
                                 exclude: Iterable[torch.nn.Parameter] = ()) -> torch.Tensor:
    """Clip the master gradients of every stage by the global norm, like ``torch.nn.utils.clip_grad_norm_``
    on the single-process model (coefficient ``max_norm / (norm + 1e-6)``, at most 1).

    Collective over each engine's dp group and over ``pp_group``. Returns the total norm before
    clipping. Gradients are left untouched when a stage overflowed (the step will be skipped).
    """
    if not max_norm > 0:
        raise ValueError(f"gradient_clip_val={max_norm!r}: the max norm must be positive")
    engines = _as_list(engines)
    found_inf = agree_overflow_across_stages(engines, pp_group)
    total = grad_sq_norm_across_stages(engines, pp_group, exclude).sqrt()
    if found_inf:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for e in engines:
        for m in e.masters:
            m.grad.mul_(coef.to(m.grad.dtype))
    return total


class ZeroPipeline:
    """One pipeline rank's training step with its stage's ZeRO engines (see the module docstring).

    Build the :class:`~lightning_scale.pipeline.runtime.PipelineRuntime` first (it synchronizes tied
    parameters), then the engines over ``stage.parameters()`` and the dp group::

        runtime = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), ...)
        engine = ZeroOptimizer(AdamW(stage.parameters()), stage=2, group=topo.dp_group, overlap_comm=False)
        zp = ZeroPipeline(runtime, [engine])
        loss = zp.train_step(tokens, targets)     # this dp rank's share of the global batch
        zp.clip_grad_norm_(1.0); zp.step(); zp.zero_grad()
    """

    def __init__(self, runtime, engines: Sequence) -> None:
        self.runtime = runtime
        self.engines = _as_list(engines)
        stage = runtime.stage
        owned = {id(p) for p in stage.parameters() if p.requires_grad}
        held = {id(slot.param) for e in self.engines for st in e.reducer.states for slot in st.bucket.slots}
        if owned - held:
            raise ConfigError(f"{len(owned - held)} trainable parameters of pipeline stage {stage.stage_ids} are in "
                              "no ZeRO engine: build the optimizer over runtime.stage.parameters()")
        if held - owned:
            raise ConfigError(f"the ZeRO engines hold {len(held - owned)} parameters that pipeline stage "
                              f"{stage.stage_ids} does not run: build the optimizer over "
                              "runtime.stage.parameters() only")
        scales = {float(e.loss_scaler.scale) for e in self.engines}
        if len(scales) > 1:
            raise ConfigError(f"the engines of one stage use different loss scales {sorted(scales)}; share one scaler")
        # A tied parameter's summed gradient lives on both holders: the first one counts it in the norm.
        self.norm_exclude = [t.param for t in stage.tied if t.ranks[0] != stage.pp_rank]

    @property
    def pp_group(self):
        return self.runtime.pp_group

    def train_step(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """All micro-batches' forward + backward with no gradient communication; returns the mean loss.

        The loss is scaled by the engines' loss scale (fp16); ``step`` unscales.
        """
        with contextlib.ExitStack() as stack:
            for e in self.engines:
                stack.enter_context(e.no_sync())
            return self.runtime.train_step(inputs, targets, grad_scale=float(self.engines[0].loss_scaler.scale))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_across_stages(self.engines, max_norm, self.pp_group, self.norm_exclude)

    def grad_norm(self) -> torch.Tensor:
        """Global gradient norm of the whole model (no clipping)."""
        return grad_sq_norm_across_stages(self.engines, self.pp_group, self.norm_exclude).sqrt()

    def step(self) -> bool:
        """Reduce-scatter (once), agree on overflow across stages, step every engine; returns found_inf."""
        found_inf = agree_overflow_across_stages(self.engines, self.pp_group)
        for e in self.engines:
            e.step()
        return found_inf

    def zero_grad(self) -> None:
        for e in self.engines:
            e.zero_grad()
