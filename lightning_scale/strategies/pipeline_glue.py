"""Pipeline parallelism inside Zero3DStrategy: the Lightning contract and the steps that replace Lightning's.

The contract a LightningModule follows (README, "Pipeline parallelism in Lightning"):

* ``pipeline_layers()`` returns the ordered layers (each layer's one tensor output is the next one's
  input); an ``nn.Sequential`` LightningModule works as is. No such sequence -> ``ConfigError``.
* batches are ``(inputs, targets)``: every pipeline rank gets the same batch (the sampler splits over dp
  only); the first stage computes on ``inputs``, the last one applies the loss to ``targets``. Or, as
  Hugging Face datasets give them, dicts ``{"input_ids", "attention_mask", "labels"}`` (the last two
  optional): the inputs are ``input_ids``, or ``stack([input_ids, attention_mask], 1)`` so the padding mask
  travels with each micro-batch (``lightning_scale.models.hf_pipeline``); the targets are ``labels``.
* ``pipeline_loss(output, target)`` is the loss of one micro-batch on the last stage (default: the mean
  next-token cross-entropy, ``lm_loss``); the step's loss is the mean over micro-batches. A dict batch
  without ``pipeline_loss`` on a Hugging Face model gets the model's own ``loss_function`` (labels shifted
  inside, -100 ignored), normalized by the label tokens of the whole batch: the step's loss and gradients
  are those of ``model(**batch).loss`` on the whole batch, however the padding falls on the micro-batches.
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
from typing import Any, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.models.gpt import lm_loss
from lightning_scale.pipeline.placement import PipelinePlacement


DICT_KEYS = ("input_ids", "attention_mask", "labels")


def _split_dict(batch: Mapping[str, Any]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    extra = sorted(str(k) for k in batch if k not in DICT_KEYS)
    if "input_ids" not in batch or extra:
        what = f"keys {extra} the pipeline does not pass on" if extra else "no 'input_ids'"
        raise ConfigError(f"pipeline parallelism takes dict batches with {', '.join(map(repr, DICT_KEYS))} "
                          f"(attention_mask and labels optional); this one has {what}. Return (inputs, targets) "
                          "and define pipeline_layers() for other inputs")
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    inputs = ids if mask is None else torch.stack([ids, mask.to(ids.dtype)], 1)  # (B, 2, T): split as one
    return inputs, batch.get("labels")


def split_batch(batch: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if isinstance(batch, Mapping):
        return _split_dict(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, torch.Tensor):
        return batch, None
    raise ConfigError("pipeline parallelism needs batches of (inputs, targets) with the batch in dim 0; got "
                      f"{type(batch).__name__}" + (f" of length {len(batch)}" if hasattr(batch, "__len__") else ""))


class PipelineGlue:
    """The Lightning steps of one pipeline rank, over the stage :func:`lightning_scale.parallelize` placed."""

    def __init__(self, placement: PipelinePlacement) -> None:
        self.placement = placement
        self.stage, self.runtime = placement.stage, placement.runtime
        self.pp_ranks, self.pp_group = placement.pp_ranks, placement.pp_group
        self.microbatches = placement.microbatches
        self.norm_exclude = placement.norm_exclude

    @staticmethod
    def check_module(module: nn.Module, pp: int) -> None:
        if not module.automatic_optimization:
            raise ConfigError(f"pp={pp}: pipeline parallelism needs automatic optimization (the strategy runs the "
                              "schedule's backward); set automatic_optimization=True")

    @staticmethod
    def loss_fn(module: nn.Module) -> "PipelineLoss":
        return PipelineLoss(module)

    def _begin(self, batch: Any) -> None:
        loss = self.runtime.loss_fn
        if isinstance(loss, PipelineLoss):
            loss.begin(batch, self.microbatches)

    def check_dataloader(self, dataloader: Any) -> None:
        self.placement.check_dataloader(dataloader)

    def materialized(self, module: nn.Module):
        return self.placement.materialized(module)

    # ------------------------------------------------------------------ steps
    def train_step(self, strategy, batch, batch_idx: int) -> torch.Tensor:
        inputs, targets = split_batch(batch)
        self._begin(batch)
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
        self._begin(batch)
        loss = self.runtime.eval_step(inputs, targets)
        if loss is None:
            raise ConfigError(f"pipeline {stage} step: the batch has no targets for the loss")
        loss = loss.to(torch.float32)
        self._report(strategy, stage, loss, batch, batch_idx)
        return loss

    def predict_step(self, strategy, batch, batch_idx: int) -> Any:
        """The last stage's outputs for the batch on every pipeline rank, passed through the module's
        ``pipeline_predict_end(outputs, batch, batch_idx)`` when it defines one."""
        if isinstance(batch, Mapping):
            inputs = split_batch(batch)[0]
        else:
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


class PipelineLoss:
    """The last stage's loss of one micro-batch: the module's ``pipeline_loss`` (default ``lm_loss``) on
    ``(inputs, targets)`` batches; on a dict batch (without ``pipeline_loss``) the Hugging Face model's own
    causal-LM loss, summed over the micro-batch's label tokens and divided by the whole batch's count over the
    micro-batches (``num_items_in_batch``), so the mean over micro-batches is the whole batch's token mean."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.user = getattr(module, "pipeline_loss", None)
        self._per_micro: Optional[torch.Tensor] = None  # set per dict batch
        self._model: Optional[nn.Module] = None
        self.sp_group = None  # Ulysses sp > 1 (set by parallelize's apply_sp): each micro-batch's whole-sequence loss

    def begin(self, batch: Any, microbatches: int) -> None:
        self._per_micro = None
        if self.user is not None or not isinstance(batch, Mapping) or batch.get("labels") is None:
            return
        self._model = self._model or self._hf()
        if self._model is None:
            raise ConfigError(f"pipeline parallelism: a dict batch on {type(self.module).__name__}, which holds no "
                              "Hugging Face causal LM; define pipeline_loss(output, labels) for its loss")
        labels = batch["labels"]
        tokens = (labels[..., 1:] != -100).sum().to(torch.float64)  # the targets after the shift, as HF's loss
        if self.sp_group is not None:  # this rank holds a slice: count the whole sequences' targets
            from lightning_scale.sequence_parallel.models import whole_sequence_targets

            tokens = whole_sequence_targets(labels, self.sp_group)
        self._per_micro = tokens / microbatches

    def _hf(self) -> Optional[nn.Module]:
        from lightning_scale.models.hf_pipeline import is_hf_causal_lm

        return next((m for m in self.module.modules() if is_hf_causal_lm(m) and hasattr(m, "loss_function")), None)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._per_micro is None:
            if self.sp_group is not None:  # the mean over the whole sequence of the slices' summed losses
                from lightning_scale.sequence_parallel.models import sequence_parallel_loss

                return sequence_parallel_loss(self.user or lm_loss, self.sp_group)(output, target)
            return (self.user or lm_loss)(output, target)
        hf = self._model
        return hf.loss_function(output, target, hf.config.vocab_size, num_items_in_batch=self._per_micro)
