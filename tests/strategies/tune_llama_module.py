"""A LightningModule holding a Hugging Face ``LlamaForCausalLM`` built from ``LlamaConfig`` (no downloads): the
autotuner's non-GPT case (``python -m lightning_scale.tune --module tune_llama_module:TinyLlama``,
``Zero3DStrategy(autotune=...)``; tests/dist/test_tune_probe.py, tests/strategies/test_autotune_trainer.py)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch

from lightning_scale.models.gpt import lm_loss

SHAPE = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _transformers():
    """``import transformers`` without the repository root on sys.path: its ``kernels/`` (shipped as
    ``lightning_scale.kernels``) would shadow the PyPI package ``kernels`` that transformers imports when installed."""
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "transformers.integrations.hub_kernels" not in sys.modules:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        saved = list(sys.path)
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != root]
        try:
            import transformers.integrations.hub_kernels  # noqa: F401
        finally:
            sys.path[:] = saved
    import transformers

    return transformers


class TinyLlama(pl.LightningModule):
    def __init__(self, **overrides) -> None:
        super().__init__()
        self.shape = dict(SHAPE, **overrides)
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        transformers = _transformers()

        cfg = transformers.LlamaConfig(**self.shape)
        cfg._attn_implementation = "sdpa"
        self.model = transformers.LlamaForCausalLM(cfg)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = lm_loss(self.model(input_ids=x).logits, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TinyMixtral(TinyLlama):
    """The same shape as a ``MixtralForCausalLM``: 4 experts of width ``intermediate_size``, 2 per token (the tuner
    tries tp > 1 with the experts split and placed, ``expert_parallel``)."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        transformers = _transformers()

        cfg = transformers.MixtralConfig(**self.shape, num_local_experts=4, num_experts_per_tok=2)
        cfg._attn_implementation = "sdpa"
        self.model = transformers.MixtralForCausalLM(cfg)
