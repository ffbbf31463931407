"""Kimi delta attention layers (Kimi Linear) cut by heads: the layout tensor and sequence parallelism run them in.

transformers' ``KimiLinearDeltaAttention`` is a gated DeltaNet whose decay is per channel: ``q_proj`` / ``k_proj`` /
``v_proj`` (``num_heads`` heads of ``head_dim`` each), a depthwise ``conv1d`` over ``[q | k | v]``, a forget gate
(``forget_gate``: a low-rank ``f_a_proj`` shared by the heads, ``f_b_proj`` to every head's channels, ``dt_bias`` per
channel, ``A_log`` per head), ``b_proj`` (beta, one per head), the output gate (low-rank ``g_a_proj`` + ``g_b_proj``), a
gated RMSNorm over each head's ``head_dim`` (``o_norm``, one weight shared by the heads) and ``o_proj``. Every head is
independent along the sequence, so a rank runs ``1 / n`` of the heads: the per-head rows (q / k / v, ``f_b_proj``,
``dt_bias``, ``b_proj``, ``g_b_proj``), the conv's channels per part, ``A_log`` by head and ``o_proj`` by columns are
cut; ``f_a_proj``, ``g_a_proj`` and ``o_norm`` stay whole (each rank's heads use all of them: their gradients summed).
One region (style ``kimi_delta``), as the other recurrent layers (:mod:`lightning_scale.tensor_parallel.mamba`).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.nn as nn

from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec

_HEAD_ROWS = ("q_proj", "k_proj", "v_proj", "g_b_proj", "forget_gate.f_b_proj")  # num_heads * head_dim rows each
WHOLE = ("forget_gate.f_a_proj", "g_a_proj", "o_norm")  # used by every head: partial gradients, summed


def is_kimi_delta(module: nn.Module) -> bool:
    """A transformers Kimi delta attention layer: the modules and counts its forward reads."""
    gate = getattr(module, "forget_gate", None)
    return (all(isinstance(module.__dict__.get(a), int) for a in ("num_heads", "head_dim", "qkv_dim", "conv_dim"))
            and all(type(getattr(module, n, None)) is nn.Linear for n in ("q_proj", "k_proj", "v_proj", "b_proj",
                                                                          "g_a_proj", "g_b_proj", "o_proj"))
            and isinstance(getattr(module, "conv1d", None), nn.Conv1d) and gate is not None
            and all(type(getattr(gate, n, None)) is nn.Linear for n in ("f_a_proj", "f_b_proj"))
            and isinstance(getattr(gate, "A_log", None), nn.Parameter)
            and isinstance(getattr(gate, "dt_bias", None), nn.Parameter)
            and isinstance(getattr(getattr(module, "o_norm", None), "weight", None), nn.Parameter))


def unsupported(module: nn.Module, n: int, setting: str = "tp") -> Optional[str]:
    """Why ``module`` cannot run cut over ``n`` ranks (None when it can)."""
    kind = type(module).__name__
    heads, dim = module.num_heads, module.head_dim
    if heads % n:
        return f"{kind}: {setting}={n} does not divide its {heads} heads"
    width = heads * dim
    gate = module.forget_gate
    if module.qkv_dim != width or module.conv_dim != 3 * width or module.conv1d.groups != module.conv_dim:
        return f"{kind}: its conv1d is not depthwise over [q | k | v] of {heads} heads of {dim}"
    if gate.A_log.shape != (1, 1, heads, 1) or gate.dt_bias.shape != (width,):
        return f"{kind}: its forget gate's A_log / dt_bias are not per head / per channel"
    biased = [p for p in (*_HEAD_ROWS, "b_proj", "o_proj", "conv1d") if module.get_submodule(p).bias is not None]
    if biased:
        return f"{kind}: {', '.join(biased)} with a bias (not a layout known here)"
    if module.o_norm.weight.shape != (dim,):
        return f"{kind}: its o_norm is not one weight over head_dim shared by the heads"
    own = [p for p, _ in module.named_parameters(recurse=False)]
    if own:
        return f"{kind}: parameters of its own ({', '.join(own)}): not a layout known here"
    return None


def specs(name: str, module: nn.Module, n: int) -> Dict[str, ShardSpec]:
    """The cut of every parameter over ``n`` ranks (by heads); ValueError naming why it cannot be."""
    why = unsupported(module, n)
    if why is not None:
        raise ValueError(f"Kimi delta attention {name!r}: {why}")
    heads, width = module.num_heads, module.qkv_dim
    out = {f"{p}.weight": make_spec(0, width, n, what=f"{name}.{p}") for p in _HEAD_ROWS}
    out["b_proj.weight"] = make_spec(0, heads, n, what=f"{name}.b_proj")
    out["forget_gate.dt_bias"] = make_spec(0, width, n, what=f"{name}.forget_gate.dt_bias")
    out["forget_gate.A_log"] = make_spec(2, heads, n, what=f"{name}.forget_gate.A_log")
    out["conv1d.weight"] = make_spec(0, 3 * width, n, parts=(width, width, width), what=f"{name}.conv1d")
    out["o_proj.weight"] = make_spec(1, width, n, what=f"{name}.o_proj")
    return out


def local_counts(module: nn.Module, specs: Dict[str, ShardSpec], n: int) -> Dict[Tuple[str, str], object]:
    """The counts the forward reads, as one of ``n`` ranks holding its slices sees them."""
    width, conv = module.qkv_dim // n, module.conv_dim // n
    out: Dict[Tuple[str, str], object] = {
        ("", "num_heads"): module.num_heads // n, ("", "qkv_dim"): width, ("", "conv_dim"): conv,
        ("forget_gate", "num_heads"): module.num_heads // n, ("forget_gate", "qkv_dim"): width,
        ("conv1d", "in_channels"): conv, ("conv1d", "out_channels"): conv, ("conv1d", "groups"): conv,
        ("o_proj", "in_features"): width, ("b_proj", "out_features"): module.num_heads // n}
    for p in _HEAD_ROWS:
        out[p, "out_features"] = width
    return out
