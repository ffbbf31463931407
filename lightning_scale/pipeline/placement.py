"""A module's pipeline stage on this rank, placed: torch only (the Lightning steps are in strategies/pipeline_glue.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError
from lightning_scale.materialize import has_meta, materialize_, swap_in
from lightning_scale.pipeline.layers import pipeline_layers
from lightning_scale.pipeline.stage import build_stage
from lightning_scale.pipeline.runtime import PipelineRuntime


class PipelinePlacement:
    """This rank's pipeline stage of a module: the stage cut, its runtime, which rank trains each tensor.

    Built by :func:`lightning_scale.parallelize.apply_pipeline` (after the tp plan, before ZeRO-3): the layers
    come from :func:`~lightning_scale.pipeline.pipeline_layers`; a module on ``meta`` gets only this stage
    allocated and initialized; the other stages' parameters are frozen and freed (shapes kept).
    """

    def __init__(self, module: nn.Module, config, topology, *, loss_fn=None, timeout=None, device=None) -> None:
        layers = pipeline_layers(module)
        pc = config.pipeline
        self.stage = build_stage(layers, pp=topology.pp, pp_rank=topology.pp_rank,
                                 virtual_stages=pc.virtual_stages, partition=pc.partition)
        device = torch.device(device) if device is not None else torch.device("cpu")
        if has_meta(module, recurse=True):
            # ZeRO-3 reads pretrained units shard by shard itself (lightning_scale.pretrained): leave them on meta
            _materialize_stage(module, self.stage, device, topology, defer_pretrained=config.zero.stage == 3)
        if loss_fn is None:
            raise ConfigError(f"pp={topology.pp}: the pipeline needs a loss for the last stage (loss_fn)")
        self.pp_ranks = topology.axis_ranks("pp")
        self.pp_group = topology.pp_group
        self.runtime = PipelineRuntime(self.stage, pp_group=self.pp_group, pp_ranks=self.pp_ranks, loss_fn=loss_fn,
                                       microbatches=pc.microbatches, schedule=pc.schedule, timeout=timeout)
        if self.runtime.device.type == "meta":  # pretrained units wait for ZeRO-3 on meta: place by the device
            self.runtime.device = device
        self.microbatches = pc.microbatches
        # Only this stage's parameters train and live here: the others are frozen and freed (their shapes kept);
        # a full state_dict re-fetches each from the pipeline rank that trains it (materialized()).
        mine = {id(p) for p in self.stage.parameters()}
        self.owner = _owners(layers, self.stage.bounds, topology.pp)
        outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in self.owner]
        if outside:
            raise ConfigError(f"trainable parameter(s) {outside[:5]} are in none of the layers pipeline_layers() "
                              "returns, so no pipeline stage would train them; include their modules in a layer "
                              "or set requires_grad=False")
        self._freed: List[Tuple[nn.Parameter, torch.Size]] = []
        for p in module.parameters():
            if id(p) not in mine:
                p.requires_grad_(False)
                self._freed.append((p, p.shape))
                if p.is_meta:  # another stage's parameter, never materialized here: an empty real tensor
                    swap_in(p, torch.empty(0, dtype=p.dtype, device=device))
                else:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        leftover = [n for n, b in module.named_buffers() if b.is_meta]
        if leftover and config.zero.stage != 3:  # ZeRO-3 materializes what is left (and names what it cannot)
            raise ConfigError(f"buffer(s) {leftover[:5]} are still on the meta device after the pipeline stage was "
                              "materialized; create buffers on a real device in configure_model")
        self.norm_exclude = [t.param for t in self.stage.tied if t.ranks[0] != self.stage.pp_rank]

    # ------------------------------------------------------------------ data
    def check_dataloader(self, dataloader: Any) -> None:
        """Micro-batches must divide the batch: fail when the loader is set up, before any step."""
        size = getattr(dataloader, "batch_size", None)
        if isinstance(size, int) and size % self.microbatches:
            raise ConfigError(f"pipeline.microbatches={self.microbatches} does not divide the batch size {size} "
                              "(per data-parallel rank)")

    # ------------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def materialized(self, module: nn.Module) -> Iterator[None]:
        """The whole, current model on this rank while inside (collective over the pp group): the other
        stages' parameters are re-allocated and every stage's tensors broadcast from the rank that trains them;
        freed again on exit (tensors taken from ``state_dict()`` inside keep their storage)."""
        with torch.no_grad():
            for p, shape in self._freed:
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
            try:
                for t in list(module.parameters()) + list(module.buffers()):
                    owner = self.owner.get(id(t))
                    if owner is not None:
                        C.broadcast(t.data, src=self.pp_ranks[owner], group=self.pp_group, tag="pp/state_dict")
                yield
            finally:
                for p, _ in self._freed:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)



@torch.no_grad()
def _materialize_stage(module: nn.Module, stage, device: torch.device, topology, defer_pretrained: bool = False
                       ) -> None:
    """A model built on ``meta`` (``configure_model`` under ``Zero3DStrategy(pp>1)``): only this rank's stage is
    allocated and initialized (the init contract of :mod:`lightning_scale.materialize`; tp layers as slices of
    their full dense layers), plus modules holding buffers; the dp replicas of the stage then take dp rank 0's
    values. No rank ever holds the whole model. ``defer_pretrained`` (ZeRO-3): modules under a recorded pretrained
    source stay on meta; ZeRO-3 then reads each rank's dp shard of them."""
    from lightning_scale.pretrained import weight_reader

    local = {id(t) for t in list(stage.parameters()) + list(stage.buffers())}
    reader = weight_reader(module) if defer_pretrained else None

    def keep(name: str, m: nn.Module) -> bool:
        if reader is not None and reader.covers(f"{name}." if name else ""):
            return False
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        return any(id(t) in local for t in own) or any(True for _ in m.buffers(recurse=False))

    materialize_(module, device, keep)
    if C.group_size(topology.dp_group) > 1:
        src = dist.get_global_rank(topology.dp_group, 0)
        for t in list(stage.parameters()) + list(stage.buffers()):
            if not t.is_meta:
                C.broadcast(t.data, src=src, group=topology.dp_group, tag="init")


def _owners(layers: Sequence[nn.Module], bounds: Sequence[int], pp: int) -> dict:
    """id(tensor) -> the pipeline rank whose stage trains it (the first holder of a tied parameter)."""
    owner: dict = {}
    for s in range(len(bounds) - 1):
        for layer in layers[bounds[s]:bounds[s + 1]]:
            for t in list(layer.parameters()) + list(layer.buffers()):
                owner[id(t)] = min(owner.get(id(t), s % pp), s % pp)
    return owner

