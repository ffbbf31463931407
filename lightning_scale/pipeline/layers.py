"""Expose a model as a flat sequence of layers, the unit the partitioners split.

The contract is small: a pipeline needs an ordered list of modules where the output of layer k is
the only input of layer k + 1 (one tensor). A model provides it by

* being an ``nn.Sequential`` (or ``nn.ModuleList`` / list of modules), or
* defining ``pipeline_layers()`` that returns such a list, or
* being the project GPT (:class:`lightning_scale.models.gpt.GPT`), handled by
  :func:`gpt_pipeline_layers` without changing the model.

The wrappers reuse the model's own modules (no copies), so parameters keep their identity: an
optimizer, a checkpoint or a test can still address them through the original model, and a tied
embedding / head stays one ``Parameter`` that the pipeline stage finds and keeps in sync.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn as nn

from lightning_scale.config import ConfigError


class GPTEmbedding(nn.Module):
    """Token + position embedding of the GPT (first pipeline layer): idx (B, T) -> x (B, T, C)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.seq_len = gpt.cfg.seq_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, T = idx.shape
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len={self.seq_len}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class GPTHead(nn.Module):
    """Final LayerNorm + LM head of the GPT (last pipeline layer): x (B, T, C) -> logits (B, T, V)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt_pipeline_layers(gpt: nn.Module) -> nn.Sequential:
    """[embedding, block_0, ..., block_{L-1}, head] sharing the GPT's modules; same math as ``gpt(idx)``."""
    return nn.Sequential(GPTEmbedding(gpt), *gpt.blocks, GPTHead(gpt))


def pipeline_layers(model: nn.Module) -> List[nn.Module]:
    """The layer sequence of ``model`` by the contract in the module docstring, or a clear error."""
    from lightning_scale.models.gpt import GPT

    hook = getattr(model, "pipeline_layers", None)
    if callable(hook):
        layers = list(hook())
    elif isinstance(model, GPT):
        layers = list(gpt_pipeline_layers(model))
    elif isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        layers = list(model)
    else:
        raise ConfigError(
            f"{type(model).__name__} exposes no layer sequence for pipeline parallelism: build it as an "
            "nn.Sequential (e.g. in configure_model) or define pipeline_layers() returning the ordered "
            "list of layers (each layer's output is the next layer's input)"
        )
    bad = [i for i, layer in enumerate(layers) if not isinstance(layer, nn.Module)]
    if bad or not layers:
        raise ConfigError(f"{type(model).__name__}.pipeline_layers() must return a non-empty list of nn.Module "
                          f"(entries {bad} are not modules)")
    return layers
