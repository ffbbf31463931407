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
* **Clipping by the global norm** and **one overflow decision** span every stage: that is the engines'
  :class:`~lightning_scale.zero.model_parallel.CrossAxis` (the one cross-axis module), which
  :func:`pipeline_cross_axis` builds for a runtime (pp group; a tied embedding / head counted once).
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError
from lightning_scale.zero.model_parallel import CrossAxis


def _as_list(engines) -> List:
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    if not engines:
        raise ValueError("engines: pass at least one ZeroOptimizer (one per optimizer of this pipeline stage)")
    return engines


def pipeline_cross_axis(runtime, tp_group=None) -> CrossAxis:
    """The :class:`~lightning_scale.zero.model_parallel.CrossAxis` of a pipeline rank's engines: the norm and the
    overflow vote span the pp group; a tied parameter (embedding / head) counts on its first holder only."""
    stage = runtime.stage
    return CrossAxis(tp_group=tp_group, pp_group=runtime.pp_group,
                     exclude=[t.param for t in stage.tied if t.ranks[0] != stage.pp_rank])


class ZeroPipeline:
    """One pipeline rank's training step with its stage's ZeRO engines (see the module docstring).

    Build the :class:`~lightning_scale.pipeline.runtime.PipelineRuntime` first (it synchronizes tied
    parameters), then the engines over ``stage.parameters()`` and the dp group::

        runtime = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), ...)
        engine = ZeroOptimizer(AdamW(stage.parameters()), stage=2, group=topo.dp_group,
                               cross_axis=pipeline_cross_axis(runtime))
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
        if C.group_size(runtime.pp_group) > 1 and any(e.cross.pp_group is None for e in self.engines):
            raise ConfigError("the stage's ZeRO engines know nothing of the pipeline: build each with "
                              "cross_axis=pipeline_cross_axis(runtime), so the norm and the overflow vote span "
                              "every stage")

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
        """Clip each engine by the global norm of its parameters over every stage (one engine: the model's)."""
        norms = [e.clip_grad_norm_(max_norm) for e in self.engines]
        return norms[0] if len(norms) == 1 else torch.stack(norms).pow(2).sum().sqrt()

    def grad_norm(self) -> torch.Tensor:
        """Global gradient norm of the whole model (no clipping)."""
        return torch.stack([e.global_grad_norm() for e in self.engines]).pow(2).sum().sqrt()

    def step(self) -> bool:
        """Reduce-scatter (once), agree on overflow across stages (in the engines), step every engine; returns
        found_inf."""
        found_inf = any([bool(e.reduce_gradients()) for e in self.engines])
        for e in self.engines:
            e.step()
        return found_inf

    def zero_grad(self) -> None:
        for e in self.engines:
            e.zero_grad()
