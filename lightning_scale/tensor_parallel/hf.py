"""Built-in plans: the project GPT, Hugging Face models' own ``tp_plan``, and Hugging Face GPT-2.

Nothing here imports ``transformers``: a Hugging Face model is recognised by its ``config.model_type``
and ``base_model_prefix`` (duck typing), so the package works without it installed.

* A Hugging Face model that declares a plan (``model.tp_plan``, assembled by ``transformers`` from the
  class' ``_tp_plan`` and ``config.base_model_tp_plan`` with the right prefixes) is used as declared.
  Its style names (``colwise``, ``rowwise``, ``colwise_gather_output``, ``embedding_rowwise``,
  ``packed_colwise``...) map onto ours; patterns of that plan that match no module (optional layers of
  other configurations) are skipped.
* GPT-2 declares no plan; its fused ``c_attn`` is a ``Conv1D`` (weight stored ``(in, out)``) holding
  ``[q | k | v]``, which the ``colwise`` style detects and splits per head.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch.nn as nn

from lightning_scale.config import ConfigError

GPT_PLAN: Dict[str, str] = {
    "wte": "vocab",
    "blocks.*.attn.qkv": "colwise",  # fused [q|k|v], split per head
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "lm_head": "vocab_colwise",  # logits stay split over the vocabulary
}

GPT2_BASE_PLAN: Dict[str, str] = {
    "wte": "vocab",
    "h.*.attn.c_attn": "colwise",  # Conv1D, fused [q|k|v], split per head
    "h.*.attn.c_proj": "rowwise",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "base_model_prefix") and hasattr(getattr(model, "config", None), "model_type")


def _base_prefix(model: nn.Module) -> str:
    base = getattr(model, "base_model", model)
    if base is model:
        return ""
    for name, module in model.named_modules():
        if module is base:
            return name + "."
    return ""


def hf_plan(model: nn.Module) -> Dict[str, str]:
    """The plan of a Hugging Face model: GPT-2's built-in one, else the model's declared ``tp_plan``."""
    prefix = _base_prefix(model)
    if model.config.model_type == "gpt2":
        plan = {prefix + k: v for k, v in GPT2_BASE_PLAN.items()}
        if isinstance(getattr(model, "lm_head", None), nn.Linear):
            plan["lm_head"] = "colwise_gather"  # HF computes the loss from full logits
        return plan
    declared = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if declared:
        return dict(declared)
    base = getattr(model.config, "base_model_tp_plan", None)
    if base:
        return {prefix + k: v for k, v in base.items()}
    raise ConfigError(f"tensor.plan: {type(model).__name__} declares no tp_plan (base_model_tp_plan); "
                      f"pass plan={{pattern: style}}")


def default_plan(model: nn.Module, sequence_parallel: bool = False) -> Dict[str, str]:
    """The built-in plan for ``model``; ConfigError when there is none."""
    from lightning_scale.models.gpt import GPT

    if isinstance(model, GPT):
        plan = dict(GPT_PLAN)
        if sequence_parallel:
            plan["wpe"] = "sequence_split"  # position rows for this rank's sequence chunk only
            plan["blocks.*.attn"] = "sequence_gather"  # the attention reads T from its input
            plan["blocks.*.mlp"] = "sequence_gather"
        return plan
    if is_hf_model(model):
        return hf_plan(model)
    raise ConfigError(f"tensor.plan: no built-in tensor-parallel plan for {type(model).__name__}; pass "
                      f"plan={{'blocks.*.attn.qkv': 'colwise', ...}}")


def find_plannable_module(root: nn.Module) -> Tuple[str, nn.Module]:
    """The outermost submodule of ``root`` with a built-in plan (the project GPT or a Hugging Face model).

    A Lightning strategy uses it to split the model a LightningModule holds (``self.model = GPT(...)``)
    when the user gave no plan: ``name, model = find_plannable_module(lightning_module)``.
    """
    from lightning_scale.models.gpt import GPT

    for name, module in root.named_modules():  # pre-order: outermost first
        if isinstance(module, GPT) or is_hf_model(module):
            return name, module
    raise ConfigError(f"tensor.plan: {type(root).__name__} contains no module with a built-in tensor-parallel "
                      f"plan (the project GPT or a Hugging Face model); pass tensor.plan={{pattern: style}}")
