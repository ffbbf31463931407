"""Pipeline parallelism inside Zero3DStrategy: the Lightning contract and the steps that replace Lightning's.

The contract a LightningModule follows (README, "Pipeline parallelism in Lightning"):

* ``pipeline_layers()`` returns the ordered layers (each layer's one tensor output is the next one's
  input); an ``nn.Sequential`` LightningModule works as is. No such sequence -> ``ConfigError``.
* batches are ``(inputs, targets)``: every pipeline rank gets the same batch (the sampler splits over dp
  only); the first stage computes on ``inputs``, the last one applies the loss to ``targets``.
* ``pipeline_loss(output, target)`` is the loss of one micro-batch on the last stage (default: the mean
  next-token cross-entropy, ``lm_loss``); the step's loss is the mean over micro-batches.
* ``training_step`` / ``validation_step`` / ``test_step`` are *not* called: the strategy runs the schedule
  instead, then hands the step's mean loss, equal on every rank, to ``pipeline_step_end(stage, loss,
  batch, batch_idx)`` if the module defines it (where it may ``self.log``), else logs ``train_loss``
  (on_step) / ``val_loss`` / ``test_loss`` (on_epoch, ``sync_dist=True``) itself.
* ``predict_step`` is not called either: prediction returns the last stage's outputs on every rank, passed
  through ``pipeline_predict_end(outputs, batch, batch_idx)`` if the module defines it.
* automatic optimization only: the schedule already ran every micro-batch's backward, so the strategy's
  ``backward`` only calls the ``on_before_backward`` / ``on_after_backward`` hooks; accumulation
  (``accumulate_grad_batches``), clipping (global norm across stages) and the ZeRO step work as usual.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError
from lightning_scale.materialize import has_meta, materialize_, swap_in
from lightning_scale.models.gpt import lm_loss
from lightning_scale.pipeline import PipelineRuntime, build_stage, pipeline_layers


def split_batch(batch: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, torch.Tensor):
        return batch, None
    raise ConfigError("pipeline parallelism needs batches of (inputs, targets) with the batch in dim 0; got "
                      f"{type(batch).__name__}" + (f" of length {len(batch)}" if hasattr(batch, "__len__") else ""))


class PipelineGlue:
    """This rank's pipeline stage, runtime and parameter owners, built once per LightningModule."""

    def __init__(self, module: nn.Module, config, topology, timeout=None, device=None) -> None:
        if not module.automatic_optimization:
            raise ConfigError(f"pp={topology.pp}: pipeline parallelism needs automatic optimization (the strategy "
                              "runs the schedule's backward); set automatic_optimization=True")
        layers = pipeline_layers(module)
        pc = config.pipeline
        self.stage = build_stage(layers, pp=topology.pp, pp_rank=topology.pp_rank,
                                 virtual_stages=pc.virtual_stages, partition=pc.partition)
        device = torch.device(device) if device is not None else torch.device("cpu")
        if has_meta(module, recurse=True):
            _materialize_stage(module, self.stage, device, topology)
        loss_fn = getattr(module, "pipeline_loss", None) or lm_loss
        self.pp_ranks = topology.axis_ranks("pp")
        self.pp_group = topology.pp_group
        self.runtime = PipelineRuntime(self.stage, pp_group=self.pp_group, pp_ranks=self.pp_ranks, loss_fn=loss_fn,
                                       microbatches=pc.microbatches, schedule=pc.schedule, timeout=timeout)
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
        if leftover:
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

    # ------------------------------------------------------------------ steps
    def train_step(self, strategy, batch, batch_idx: int) -> torch.Tensor:
        inputs, targets = split_batch(batch)
        trainer = strategy.lightning_module.trainer
        scaler = getattr(strategy.precision_plugin, "loss_scaler", None)
        scale = float(scaler.scale) if scaler is not None else 1.0
        # Lightning divides the returned loss by accumulate_grad_batches before its backward; the schedule's
        # backward is the real one, so it applies that factor (and the fp16 loss scale) itself.
        accumulate = max(1, trainer.accumulate_grad_batches)
        grad_scale = scale / accumulate
        # Lightning zeroes gradients between training_step and backward, on the first batch of each
        # accumulation cycle: here that comes first, and that one zero_grad() is skipped.
        first = batch_idx % accumulate == 0
        if first:
            for engine in strategy.engines:
                engine.zero_grad()
        with contextlib.ExitStack() as stack:
            for engine in strategy.engines:
                stack.enter_context(engine.no_sync())  # reduce once per optimizer step, in engine.step()
            loss = self.runtime.train_step(inputs, targets, grad_scale=grad_scale)
        if first:
            for engine in strategy.engines:
                engine.keep_gradients_once()
        loss = loss.to(torch.float32)
        self._report(strategy, "train", loss, batch, batch_idx)
        return loss

    def eval_step(self, strategy, stage: str, batch, batch_idx: int) -> torch.Tensor:
        inputs, targets = split_batch(batch)
        loss = self.runtime.eval_step(inputs, targets)
        if loss is None:
            raise ConfigError(f"pipeline {stage} step: the batch has no targets for the loss")
        loss = loss.to(torch.float32)
        self._report(strategy, stage, loss, batch, batch_idx)
        return loss

    def predict_step(self, strategy, batch, batch_idx: int) -> Any:
        """The last stage's outputs for the batch on every pipeline rank, passed through the module's
        ``pipeline_predict_end(outputs, batch, batch_idx)`` when it defines one."""
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        _, out = self.runtime.eval_step(inputs, None, return_outputs=True)
        box = [out.cpu() if out is not None else None]
        if self.stage.pp > 1:
            dist.broadcast_object_list(box, src=self.pp_ranks[-1], group=self.pp_group)
        out = box[0].to(inputs.device)
        hook = getattr(strategy.lightning_module, "pipeline_predict_end", None)
        return hook(out, batch, batch_idx) if callable(hook) else out

    @staticmethod
    def _report(strategy, stage: str, loss: torch.Tensor, batch, batch_idx: int) -> None:
        module = strategy.lightning_module
        hook = getattr(module, "pipeline_step_end", None)
        if callable(hook):
            hook(stage, loss, batch, batch_idx)
        elif stage == "train":
            module.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        else:
            module.log(f"{stage}_loss", loss, on_epoch=True, sync_dist=True)

    @staticmethod
    def backward(strategy, closure_loss: torch.Tensor) -> torch.Tensor:
        """The schedule already ran the backward: only Lightning's hooks around it run here."""
        module = strategy.lightning_module
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

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
def _materialize_stage(module: nn.Module, stage, device: torch.device, topology) -> None:
    """A model built on ``meta`` (``configure_model`` under ``Zero3DStrategy(pp>1)``): only this rank's stage is
    allocated and initialized (the init contract of :mod:`lightning_scale.materialize`; tp layers as slices of
    their full dense layers), plus modules holding buffers; the dp replicas of the stage then take dp rank 0's
    values. No rank ever holds the whole model."""
    local = {id(t) for t in list(stage.parameters()) + list(stage.buffers())}

    def keep(name: str, m: nn.Module) -> bool:
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        return any(id(t) in local for t in own) or any(True for _ in m.buffers(recurse=False))

    materialize_(module, device, keep)
    if C.group_size(topology.dp_group) > 1:
        src = dist.get_global_rank(topology.dp_group, 0)
        for t in list(stage.parameters()) + list(stage.buffers()):
            C.broadcast(t.data, src=src, group=topology.dp_group, tag="init")


def _owners(layers: Sequence[nn.Module], bounds: Sequence[int], pp: int) -> dict:
    """id(tensor) -> the pipeline rank whose stage trains it (the first holder of a tied parameter)."""
    owner: dict = {}
    for s in range(len(bounds) - 1):
        for layer in layers[bounds[s]:bounds[s + 1]]:
            for t in list(layer.parameters()) + list(layer.buffers()):
                owner[id(t)] = min(owner.get(id(t), s % pp), s % pp)
    return owner

