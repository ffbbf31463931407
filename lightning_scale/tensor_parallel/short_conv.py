"""Short gated convolution layers (LFM2's ``*ShortConv``) cut by channels: the layout sequence parallelism runs them in.

LFM2's convolution layers project the hidden states to ``[B | C | x]`` (``in_proj``, three parts of the hidden size),
run a depthwise causal ``conv`` (a few positions wide) over ``B * x``, gate its output with ``C`` and project back
(``out_proj``). Every channel is independent of the others, so a rank can run ``1 / n`` of them on the whole sequence:
``in_proj``'s rows cut per part (its bias too), the conv's channels, ``out_proj``'s columns; the counts the conv reads
(its channels) become the local ones. Sequence parallelism (:mod:`lightning_scale.sequence_parallel.mamba`) runs these
layers this way over the sp group.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.nn as nn

from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec


def is_short_conv(module: nn.Module) -> bool:
    """A transformers short gated convolution layer (LFM2's): in_proj to [B | C | x], a depthwise conv, out_proj."""
    conv, inp, out = getattr(module, "conv", None), getattr(module, "in_proj", None), getattr(module, "out_proj", None)
    if not (isinstance(conv, nn.Conv1d) and type(inp) is nn.Linear and type(out) is nn.Linear):
        return False
    width = conv.in_channels
    return conv.groups == width == conv.out_channels and inp.out_features == 3 * width and out.in_features == width


def unsupported(module: nn.Module, n: int, setting: str = "tp") -> Optional[str]:
    """Why ``module`` cannot run cut over ``n`` ranks (None when it can)."""
    kind = type(module).__name__
    width = module.conv.in_channels
    if width % n:
        return f"{kind}: {setting}={n} does not divide its {width} channels"
    own = [p for p, _ in module.named_parameters(recurse=False)]
    if own:
        return f"{kind}: parameters of its own ({', '.join(own)}): not a short-convolution layout known here"
    return None


def specs(name: str, module: nn.Module, n: int) -> Dict[str, ShardSpec]:
    """The cut of every parameter over ``n`` ranks (by channels); ValueError naming why it cannot be."""
    why = unsupported(module, n)
    if why is not None:
        raise ValueError(f"short convolution {name!r}: {why}")
    width = module.conv.in_channels
    parts = (width, width, width)
    out = {"in_proj.weight": make_spec(0, 3 * width, n, parts=parts, what=f"{name}.in_proj"),
           "conv.weight": make_spec(0, width, n, what=f"{name}.conv"),
           "out_proj.weight": make_spec(1, width, n, what=f"{name}.out_proj")}
    if module.in_proj.bias is not None:
        out["in_proj.bias"] = make_spec(0, 3 * width, n, parts=parts, what=f"{name}.in_proj.bias")
    if module.conv.bias is not None:
        out["conv.bias"] = make_spec(0, width, n, what=f"{name}.conv.bias")
    return out  # out_proj's bias: added by one rank (the caller's rule for a sum over ranks)


def local_counts(module: nn.Module, specs: Dict[str, ShardSpec], n: int) -> Dict[Tuple[str, str], object]:
    """The counts the forward reads, as one of ``n`` ranks holding its slices sees them."""
    local = module.conv.in_channels // n
    return {("conv", "in_channels"): local, ("conv", "out_channels"): local, ("conv", "groups"): local,
            ("in_proj", "out_features"): 3 * local, ("out_proj", "in_features"): local}
