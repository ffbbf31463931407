"""The GPT as a LightningModule (the example, the strategy tests and the benchmarks use this one)."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Dict, Optional, Union

import lightning.pytorch as pl
import torch
import torchmetrics

from lightning_scale.models.gpt import GPT, GPTConfig, lm_loss
from lightning_scale.tensor_parallel import gather_from_region, tensor_parallel_state


class GPTLightningModule(pl.LightningModule):
    """Builds the GPT in ``configure_model`` (deferred: strategies decide device, dtype and sharding).

    AdamW with two parameter groups (weight decay on matrices only), linear warm-up then cosine decay.
    ``attention`` optionally swaps in block-sparse attention (a lightning_scale.nn sparsity config).
    """

    def __init__(self, model: Union[GPTConfig, Dict[str, Any]] = GPTConfig(), lr: float = 3e-3,
                 weight_decay: float = 0.1, betas: tuple = (0.9, 0.95), warmup_steps: int = 20,
                 max_steps: int = 1000, min_lr_ratio: float = 0.1, attention: Optional[Any] = None,
                 optimizer: str = "adamw", freeze_step: Optional[int] = None) -> None:
        super().__init__()
        self.cfg = model if isinstance(model, GPTConfig) else GPTConfig(**model)
        self.cfg.validate()
        if optimizer not in ("adamw", "onebit_adam", "sgd"):
            raise ValueError(f"optimizer={optimizer!r}: use 'adamw', 'onebit_adam' or 'sgd'")
        self.save_hyperparameters({"model": asdict(self.cfg), "lr": lr, "weight_decay": weight_decay,
                                   "betas": tuple(betas), "warmup_steps": warmup_steps, "max_steps": max_steps,
                                   "min_lr_ratio": min_lr_ratio, "optimizer": optimizer})
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.max_steps, self.min_lr_ratio = warmup_steps, max_steps, min_lr_ratio
        self.attention = attention
        self.optimizer_name = optimizer
        self.freeze_step = freeze_step
        self.model: Optional[GPT] = None
        self.val_perplexity = torchmetrics.MeanMetric()  # synced across ranks by torchmetrics itself

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = GPT(self.cfg)
        if self.attention is not None:
            from lightning_scale.nn import swap_gpt_attention

            swap_gpt_attention(self.model, self.attention)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def pipeline_layers(self):
        """The layer sequence pipeline parallelism partitions: embedding, each block, head."""
        from lightning_scale.pipeline import gpt_pipeline_layers

        return gpt_pipeline_layers(self.model)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy. Under tensor parallelism the head's logits are split over the
        vocabulary: the vocab-parallel cross-entropy gives the same loss on every tp rank without gathering
        them. Also the per-micro-batch loss of the pipeline contract."""
        state = tensor_parallel_state(self.model)
        if state is not None and state.vocab_size is not None:
            return state.cross_entropy(logits, targets)
        return lm_loss(logits, targets)

    def full_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T, vocab) logits; vocabulary-split logits (tensor parallel) are gathered, padding dropped."""
        return self._gather_vocab(self.model(idx))

    def pipeline_predict_end(self, logits: torch.Tensor, batch, batch_idx: int) -> torch.Tensor:
        """Pipeline contract: the last stage's logits -> token predictions, like ``predict_step``."""
        return self._gather_vocab(logits).argmax(-1)

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        state = tensor_parallel_state(self.model)
        if state is not None and state.vocab_size is not None:
            logits = gather_from_region(logits, state.group)[..., :state.vocab_size]
        return logits

    def pipeline_step_end(self, stage: str, loss: torch.Tensor, batch, batch_idx: int) -> None:
        """Pipeline contract: the strategy ran the schedule; log its mean loss like the *_step methods do."""
        self._log_loss(stage, loss)

    def _log_loss(self, stage: str, loss: torch.Tensor) -> None:
        if stage == "train":
            self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        elif stage == "val":
            self.log("val_loss", loss, prog_bar=True, on_epoch=True, sync_dist=True)
            self.val_perplexity.update(torch.exp(loss.detach().float()))
            self.log("val_ppl", self.val_perplexity, on_epoch=True)
        else:
            self.log(f"{stage}_loss", loss, on_epoch=True, sync_dist=True)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model.loss(x, y)  # = pipeline_loss(model(x), y); chunked above model.loss_chunk
        self._log_loss("train", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model.loss(x, y)  # = pipeline_loss(model(x), y); chunked above model.loss_chunk
        self._log_loss("val", loss)
        return loss

    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model.loss(x, y)  # = pipeline_loss(model(x), y); chunked above model.loss_chunk
        self._log_loss("test", loss)
        return loss

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.full_logits(x).argmax(-1)

    def configure_optimizers(self):
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "onebit_adam":
            from lightning_scale.optim import OneBitAdam

            freeze = self.freeze_step if self.freeze_step is not None else max(1, self.max_steps // 5)
            opt = OneBitAdam(groups, lr=self.lr, betas=self.betas, freeze_step=freeze)
        elif self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        warmup, total, floor = self.warmup_steps, max(1, self.max_steps), self.min_lr_ratio

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
