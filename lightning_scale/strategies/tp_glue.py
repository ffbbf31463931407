"""Tensor parallelism inside Zero3DStrategy: which module the plan splits, and the consolidated state_dict.

The plan (``tensor.plan``, or the built-in one) is applied to the outermost submodule of the
LightningModule that has a built-in plan (the project GPT, a Hugging Face model: e.g. ``self.model``),
so plan patterns are relative to that model (``blocks.*.attn.qkv``). A module that holds neither gets
the user's plan applied to the LightningModule itself (patterns relative to it). Every rank splits the
same weights (rank 0's, broadcast just before), so each keeps its own slices.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.tensor_parallel import (
    apply_tensor_parallel,
    consolidate_state_dict,
    find_plannable_module,
    shard_state_dict,
)


def plan_target(module: nn.Module, plan) -> Tuple[str, nn.Module]:
    """(name, submodule) the plan applies to: the outermost plannable model, else the module itself."""
    try:
        return find_plannable_module(module)
    except ConfigError:
        if plan is None:
            raise
        return "", module


def apply_plan(module: nn.Module, config, tp_group) -> Tuple[str, nn.Module]:
    """Split ``module`` (the LightningModule) over ``tp_group``; returns the split submodule and its name.

    ``ConfigError`` naming the setting (heads / hidden size not divisible, unknown style, pattern matching
    nothing, plan applied twice) is raised identically on every rank, before any communication.
    """
    name, target = plan_target(module, config.tensor.plan)
    apply_tensor_parallel(target, config.tensor.plan, tp_group, sequence_parallel=config.tensor.sequence_parallel)
    return name, target


@torch.no_grad()
def full_state_dict(module: nn.Module, name: str, target: nn.Module,
                    values: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` with the split submodule's tensors gathered to the original keys and shapes.

    ``values``: this rank's local tensors to use instead of the module's own (LightningModule keys; ZeRO-3
    passes its dp-gathered fp32 masters, since its parameters are freed between steps).
    Collective over the tp group (every tp rank must call it).
    """
    out = dict(values) if values is not None else module.state_dict()
    prefix = name + "." if name else ""
    sub = None if values is None else {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
    for key, value in consolidate_state_dict(target, values=sub).items():
        out[prefix + key] = value
    return out


def shard_full_state_dict(full: Dict[str, torch.Tensor], name: str, target: nn.Module) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`full_state_dict` on this rank: the split submodule's tensors sliced (no communication)."""
    prefix = name + "." if name else ""
    sub = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
    out = dict(full)
    for key, value in shard_state_dict(target, sub).items():
        out[prefix + key] = value
    return out
