"""Tensor / pipeline parallelism for Zero3DStrategy: what the strategy's small hooks delegate to.

Order, on every rank (``Zero3DStrategy.setup``): ``configure_model`` built the model on the meta device (or
for real: then rank 0's weights are broadcast) -> :meth:`ModelParallel.apply`: the tp plan splits it (each rank
keeps its slices), then the pipeline stage is cut from the split layers; a meta model is materialized for the
local slices / stage only (at ZeRO-3, unit by unit by the engine) -> ``configure_optimizers`` -> each
optimizer is wrapped in a :class:`~lightning_scale.strategies.mp_engine.ModelParallelZeroOptimizer`
(ZeRO over dp of this rank's local, trainable parameters; norm and overflow over dp x pp x tp).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError
from lightning_scale.materialize import has_meta, materialize_
from lightning_scale.strategies import tp_glue
from lightning_scale.strategies.mp_engine import ModelParallelStage3Optimizer, ModelParallelZeroOptimizer
from lightning_scale.strategies.pipeline_glue import PipelineGlue


@torch.no_grad()
def _materialize_tp(module: nn.Module, topology, device: torch.device) -> None:
    """tp without pp, built on meta: every rank allocates only its slices (each tp layer initialized as its full
    dense layer, then sliced); dp replicas take dp rank 0's values."""
    materialize_(module, device, lambda name, m: True)
    if C.group_size(topology.dp_group) > 1:
        src = dist.get_global_rank(topology.dp_group, 0)
        for t in list(module.parameters()) + list(module.buffers()):
            C.broadcast(t.data, src=src, group=topology.dp_group, tag="init")


class ModelParallel:
    def __init__(self, config, topology) -> None:
        self.config, self.topology = config, topology
        self.module: Optional[nn.Module] = None  # the LightningModule it was applied to
        self.tp_name, self.tp_model = "", None
        self.pipeline: Optional[PipelineGlue] = None

    @staticmethod
    def check_config(config) -> None:
        """What the strategy cannot run yet, rejected on every rank before any model is touched."""
        if config.pp > 1 and config.tp > 1 and config.zero.stage == 3:
            raise ConfigError(f"zero.stage=3 with pp={config.pp} and tp={config.tp}: ZeRO-3 composes with tp or with "
                              "pp, not with both yet; use zero.stage 1 or 2 for 3D")
        if config.pp > 1 and config.zero.stage == 3 and config.pipeline.schedule == "zero_bubble":
            raise ConfigError("zero.stage=3 with pipeline.schedule='zero_bubble': ZeRO-3 reduce-scatters each "
                              "unit's gradient when its backward ends, which the deferred weight gradients of the "
                              "zero-bubble schedule bypass; use '1f1b', 'gpipe' or 'interleaved_1f1b'")

    def applied_to(self, module: nn.Module) -> bool:
        return self.module is module

    def apply(self, module: nn.Module, timeout=None, device=None) -> None:
        if self.applied_to(module):
            return  # validate / test / predict after fit: already split
        if self.module is not None:
            raise ConfigError("Zero3DStrategy(tp>1 or pp>1) was already applied to another LightningModule; "
                              "use a new strategy object per model")
        cfg, topo = self.config, self.topology
        if cfg.tp > 1:
            self.tp_name, self.tp_model = tp_glue.apply_plan(module, cfg, topo.tp_group)
        if cfg.pp > 1:
            self.pipeline = PipelineGlue(module, cfg, topo, timeout=timeout, device=device)
            if cfg.zero.stage == 3 and self.pipeline.stage.tied:
                raise ConfigError(f"zero.stage=3 with pp={cfg.pp}: parameter(s) "
                                  f"{[t.name for t in self.pipeline.stage.tied][:3]} are shared by two pipeline "
                                  "stages (a tied embedding / head); untie them or use zero.stage 1 or 2")
        elif cfg.zero.stage < 3 and has_meta(module, recurse=True):
            _materialize_tp(module, topo, torch.device(device) if device is not None else torch.device("cpu"))
        self.module = module

    # ------------------------------------------------------------------ optimizers
    def engine_factory(self) -> Tuple[type, Dict[str, Any]]:
        """The engine class and the extra keyword arguments ``_wrap_optimizers`` passes it."""
        topo = self.topology
        return ModelParallelZeroOptimizer, {
            "tp_group": topo.tp_group, "pp_group": topo.pp_group, "model": self.tp_model,
            "norm_exclude": self.pipeline.norm_exclude if self.pipeline is not None else (),
        }

    def stage3_engine_factory(self) -> Tuple[type, Dict[str, Any]]:
        """ZeRO-3 x tp: the Stage3Optimizer variant whose norm / overflow / partial gradients span tp."""
        return ModelParallelStage3Optimizer, {"tp_group": self.topology.tp_group, "pp_group": self.topology.pp_group,
                                              "model": self.tp_model}

    @torch.no_grad()
    def consolidate_stage3(self, local: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """ZeRO-3: this rank's dp-gathered state (its tp slices of its pipeline stage) -> the whole model with the
        original keys and shapes, on every rank. Collective over tp and pp."""
        if self.tp_model is not None:
            local = self.consolidate_tp(local)
        if self.pipeline is None:
            return local
        parts: List[Optional[Dict[str, torch.Tensor]]] = [None] * self.topology.pp
        dist.all_gather_object(parts, {k: v for k, v in local.items() if v.numel() > 0}, group=self.topology.pp_group)
        full: Dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                full.setdefault(k, v)
        order = list(self.module.state_dict(keep_vars=True))
        return {k: full[k] for k in order if k in full}

    def check_optimizer(self, optimizer: Any) -> None:
        if getattr(optimizer, "handles_gradient_reduction", False):
            raise ConfigError(f"{type(optimizer).__name__} reduces its own gradients over dp only; with "
                              f"tp={self.config.tp}, pp={self.config.pp} use an optimizer the ZeRO engine wraps "
                              "(e.g. AdamW)")

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The LightningModule's state_dict with the original model's keys and shapes (collective)."""
        with self._whole_model():
            if self.tp_model is not None:
                return tp_glue.full_state_dict(self.module, self.tp_name, self.tp_model)
            return self.module.state_dict()

    @torch.no_grad()
    def consolidate_tp(self, local: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """ZeRO-3 x tp: a state_dict of this rank's tp slices (LightningModule keys, e.g. the dp-gathered fp32
        masters) -> the original model's keys and shapes. Collective over the tp group."""
        full = tp_glue.full_state_dict(self.module, self.tp_name, self.tp_model, values=local)
        order = list(self.module.state_dict(keep_vars=True))  # the module's key order (no tensor is read)
        return {k: full[k] for k in order if k in full} | {k: v for k, v in full.items() if k not in order}

    @torch.no_grad()
    def load_full_state_dict(self, full: Dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a consolidated state_dict (original keys and shapes) into the split module (collective over pp):
        each rank keeps its tp slices and its own stage's tensors."""
        if self.tp_model is not None:
            full = tp_glue.shard_full_state_dict(full, self.tp_name, self.tp_model)
        with self._whole_model():
            self.module.load_state_dict(full, strict=strict)

    def _whole_model(self):
        return self.pipeline.materialized(self.module) if self.pipeline is not None else contextlib.nullcontext()
