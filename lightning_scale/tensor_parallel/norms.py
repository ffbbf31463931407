"""Style ``rmsnorm_split``: an RMSNorm over features that tp splits (BitNet's sub-layer norms).

BitNet normalizes the attention's output (every head's, before ``o_proj``) and the gated MLP's intermediate (before
``down_proj``) with an RMSNorm over the whole width: under tp a rank holds only its heads' / its slice's features,
between a column-parallel and a row-parallel layer. The norm is kept there, split: each rank keeps its slice of the
weight (cut along the features, dim 0) and computes the mean square over the whole width from its features' sum of
squares, summed over tp (one all-reduce of one number per token; its backward sums the gradient the same way, since
every rank's outputs depend on every rank's features through it). Then ``weight * x * rsqrt(mean + eps)`` on its own
features, in float32 as transformers' Llama / BitNet RMSNorm (``variance_epsilon``), cast back to the input's dtype.
Exact up to the order of the sum of squares.

Only the Llama-form RMSNorm (``weight * x / rms``, attribute ``variance_epsilon``) is taken: a norm of another form
(Gemma's ``1 + weight``, a LayerNorm) is refused by name.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from lightning_scale.tensor_parallel.experts import keep_local
from lightning_scale.tensor_parallel.mappings import copy_to_region, reduce_from_region, tp_rank
from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec


def unsupported(module: nn.Module) -> Optional[str]:
    """Why ``rmsnorm_split`` cannot take ``module`` (None when it can)."""
    kind = type(module).__name__
    weight = getattr(module, "weight", None)
    if not kind.endswith("RMSNorm") or kind.startswith("Gemma") or not isinstance(
            getattr(module, "variance_epsilon", None), float):
        return f"{kind} is not a Llama-form RMSNorm (weight * x / rms, with variance_epsilon)"
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return f"{kind} has no 1-D weight"
    return None


def norm_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    """The weight's spec (dim 0, the features, over ``tp``); ValueError when tp does not divide them."""
    why = unsupported(module)
    if why is not None:
        raise ValueError(f"style 'rmsnorm_split' on {name!r}: {why}")
    return {"weight": make_spec(0, module.weight.shape[0], tp, what=f"the features of {name!r}")}


def _hook(group, tag: str, features: int):
    def hook(module, args, output):
        x = args[0]
        h = x.float()
        # the whole width's sum of squares: summed over tp forward and backward (every rank's outputs read it)
        squares = reduce_from_region(copy_to_region(h.pow(2).sum(-1, keepdim=True), group, tag=tag), group, tag=tag)
        return module.weight * (h * torch.rsqrt(squares / features + module.variance_epsilon)).to(x.dtype)

    return hook


@torch.no_grad()
def split_norm(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group) -> List[object]:
    """Keep this rank's slice of the norm's weight (in place; meta stays meta) and install the forward hook that
    normalizes over the whole width. Returns the hook handles."""
    import types

    from lightning_scale.tensor_parallel import experts as split_style

    spec = specs["weight"]
    keep_local(module, "weight", spec, tp_rank(group))
    module._tp_expert_specs = dict(specs)  # re-marked after .to_empty() (experts._apply)
    module._apply = types.MethodType(split_style._apply, module)
    return [module.register_forward_hook(_hook(group, f"tp/{name}", spec.size))]
