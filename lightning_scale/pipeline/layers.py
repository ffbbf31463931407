"""Expose a model as a flat sequence of layers, the unit the partitioners split.

The contract is small: a pipeline needs an ordered list of modules where the output of layer k is
the only input of layer k + 1 (one tensor). A model provides it by

* being an ``nn.Sequential`` (or ``nn.ModuleList`` / list of modules), or
* defining ``pipeline_layers()`` that returns such a list, or
* matching a registered *layer provider* (:func:`register_layer_provider`): a model family's adapter,
  e.g. :mod:`lightning_scale.models.hf_pipeline` for Hugging Face causal LMs, registers a predicate and
  a builder. This package imports no model: the project GPT defines ``pipeline_layers()`` (built from
  :func:`gpt_pipeline_layers`), the adapters register themselves when ``lightning_scale.models`` is
  imported.

A LightningModule that holds such a model (``self.model = LlamaForCausalLM(cfg)``) is searched for the
outermost submodule with a hook or a provider.

The wrappers reuse the model's own modules (no copies), so parameters keep their identity: an
optimizer, a checkpoint or a test can still address them through the original model, and a tied
embedding / head stays one ``Parameter`` that the pipeline stage finds and keeps in sync.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

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
        x = self.wte(idx)
        if self.wpe is not None:  # learned positions (a rotary GPT rotates q and k in its attentions instead)
            x = x + self.wpe(torch.arange(T, device=idx.device))
        return self.drop(x)  # (B, T, C)


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


_PROVIDERS: List[Tuple[str, Callable[[nn.Module], bool], Callable[[nn.Module], nn.Module]]] = []


def register_layer_provider(name: str, matches: Callable[[nn.Module], bool],
                            build: Callable[[nn.Module], nn.Module]) -> None:
    """Let :func:`pipeline_layers` handle models ``matches(model)`` accepts with ``build(model)`` (the layer
    sequence). Re-registering a name replaces it."""
    _PROVIDERS[:] = [p for p in _PROVIDERS if p[0] != name]
    _PROVIDERS.append((name, matches, build))


def _direct(model: nn.Module) -> Optional[List[nn.Module]]:
    hook = getattr(model, "pipeline_layers", None)
    if callable(hook):
        return list(hook())
    if isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        return list(model)
    for _, matches, build in _PROVIDERS:
        if matches(model):
            return list(build(model))
    return None


def pipeline_layers(model: nn.Module) -> List[nn.Module]:
    """The layer sequence of ``model`` by the contract in the module docstring, or a clear error."""
    layers = _direct(model)
    if layers is None and isinstance(model, nn.Module):
        for _, sub in list(model.named_modules())[1:]:  # pre-order: the outermost provider wins
            if callable(getattr(sub, "pipeline_layers", None)) or any(m(sub) for _, m, _ in _PROVIDERS):
                layers = _direct(sub)
                break
    if layers is None:
        raise ConfigError(
            f"{type(model).__name__} exposes no layer sequence for pipeline parallelism: build it as an "
            "nn.Sequential (e.g. in configure_model), hold a model with a built-in adapter (the project GPT, a "
            "Hugging Face causal LM with a base_model_pp_plan), or define pipeline_layers() returning the ordered "
            "list of layers (each layer's output is the next layer's input)"
        )
    bad = [i for i, layer in enumerate(layers) if not isinstance(layer, nn.Module)]
    if bad or not layers:
        raise ConfigError(f"{type(model).__name__}.pipeline_layers() must return a non-empty list of nn.Module "
                          f"(entries {bad} are not modules)")
    return layers
