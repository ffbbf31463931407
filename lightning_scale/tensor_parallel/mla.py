"""Style ``mla_kv_a_proj``: tensor parallelism of multi-head latent attention (DeepSeek-V2/V3 and their kin).

The attention's shared key / value down-projection ``kv_a_proj_with_mqa`` stays whole on every rank; its output is
``[latent | k_rot]``. The latent part goes through ``kv_a_layernorm`` into the column-parallel ``kv_b_proj``, whose
input gradient comes back whole; the rotary part ``k_rot`` (the attention's ``qk_rope_head_dim`` last features) goes
straight to this rank's heads, so its gradient is partial per rank and is all-reduced over tp in the backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.tensor_parallel.mappings import copy_to_region


def rope_width(name: str, module: nn.Module, parent: Optional[nn.Module]) -> int:
    """The rotary features at the end of an MLA key / value down-projection's output (``qk_rope_head_dim`` of its
    attention or the attention's config); ConfigError naming ``name`` when there is none below its width."""
    width = getattr(parent, "qk_rope_head_dim", None)
    width = width if isinstance(width, int) else getattr(getattr(parent, "config", None), "qk_rope_head_dim", None)
    if not isinstance(width, int) or not 0 < width < module.out_features:
        raise ConfigError(f"tensor.plan: style 'mla_kv_a_proj' on {name!r}: its attention declares no "
                          f"qk_rope_head_dim below its {module.out_features} output features (the rotary part of "
                          "[latent | k_rot])")
    return width


def install(module: nn.Module, group, tag: str, rope: int):
    """The forward hook on ``module`` (kept whole) that sends its ``k_rot`` through ``copy_to_region``; its handle."""
    def hook(mod, args, output):  # [latent | k_rot]: k_rot feeds this rank's heads only, its gradient is partial
        latent, k_rot = output.split([output.shape[-1] - rope, rope], dim=-1)
        return torch.cat([latent, copy_to_region(k_rot, group, tag=tag)], dim=-1)

    return module.register_forward_hook(hook)
