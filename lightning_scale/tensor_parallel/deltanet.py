"""Gated DeltaNet layers (Qwen3-Next, Qwen 3.5) cut by heads: the layout sequence parallelism runs them in.

transformers' ``*GatedDeltaNet`` (a linear-attention layer: a delta-rule state per value head carried along the
sequence) projects the hidden states to queries and keys (``num_k_heads`` heads of ``head_k_dim``), values and the
output gate (``num_v_heads`` of ``head_v_dim``, a multiple of the key heads: value head j reads key head
``j // (num_v_heads / num_k_heads)``), and per value head ``b`` (beta) and ``a`` (the decay, with ``A_log`` /
``dt_bias``); a depthwise ``conv1d`` over ``[q | k | v]``, the delta rule per head, a gated RMSNorm over each head's
``head_v_dim`` (one weight shared by the heads) and ``out_proj``. Every head is independent along the sequence, so a
rank can run ``1 / n`` of the key heads with their value heads:

* Qwen3-Next: ``in_proj_qkvz`` holds, per key head, ``[q | k | v | z]`` of that head's group, and ``in_proj_ba``
  ``[b | a]`` of it: a contiguous cut of their rows is a cut by whole key-head groups;
* Qwen 3.5: ``in_proj_qkv`` rows ``[q | k | v]`` cut per part, ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` by rows;
* OLMo hybrid: ``q_proj`` / ``k_proj`` / ``v_proj`` / ``g_proj`` (the gate) / ``b_proj`` / ``a_proj`` each by rows, its
  output ``o_proj`` and gated norm ``o_norm`` in place of ``out_proj`` / ``norm``;
* ``conv1d``'s channels ``[q | k | v]`` per part, ``A_log`` / ``dt_bias`` by value head, ``out_proj`` by columns;
* the norm's weight stays whole (each rank's heads use all of it: a partial gradient);
* the counts the forward reads (``num_k_heads``, ``num_v_heads``, ``key_dim``, ``value_dim``, ``conv_dim``, the conv's
  channels) become the local ones.

Tensor parallelism runs them this way as one region (style ``gated_deltanet``: the gradients of its inputs summed over
tp on the way in, its output on the way out, the norm's gradient summed), in place of the models' declared plans
(their projections split and all-gathered, every head's core on every rank: :func:`released_projections`); sequence
parallelism (:mod:`lightning_scale.sequence_parallel.mamba`) over the sp group on the whole sequence.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.nn as nn

from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec

_COUNTS = ("num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_dim")
_LAYOUTS = {"qkvz": ("in_proj_qkvz", "in_proj_ba"), "split": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
            # OLMo hybrid: a projection per part (the gate g_proj), its output o_proj, its gated norm o_norm
            "olmo": ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")}
PROJECTIONS = tuple(p for names in _LAYOUTS.values() for p in names)
_OUT_NORM = {"olmo": ("o_proj", "o_norm")}  # layout -> (output projection, gated norm); else out_proj / norm


def out_name(module: nn.Module) -> str:
    """The name of a gated DeltaNet layer's output projection (``out_proj``; OLMo hybrid's ``o_proj``)."""
    return _OUT_NORM.get(_layout(module), ("out_proj", "norm"))[0]


def norm_name(module: nn.Module) -> str:
    """The name of its gated norm (``norm``; OLMo hybrid's ``o_norm``)."""
    return _OUT_NORM.get(_layout(module), ("out_proj", "norm"))[1]


def released_projections(model: nn.Module, plan: Dict[str, object], n: int) -> Dict[str, object]:
    """``plan`` without the entries that only split the projections of gated DeltaNet layers ``n`` ranks can cut by
    heads (the models' declared ``colwise_gather_output`` on ``in_proj_*`` / ``out_proj``: every rank then runs every
    head on gathered projections); those layers get style ``gated_deltanet`` instead (one region, the core cut)."""
    import re

    layers = {name for name, m in model.named_modules() if name and is_gated_deltanet(m) and unsupported(m, n) is None}
    if not layers:
        return plan
    names = [name for name, _ in model.named_modules() if name]
    modules = dict(model.named_modules())
    owned = {f"{layer}.{p}" for layer in layers for p in (*_LAYOUTS[_layout(modules[layer])], out_name(modules[layer]))}
    kept = {}
    for pattern, style in plan.items():
        rx = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        hits = [name for name in names if rx.match(name)]
        if not (hits and all(h in owned for h in hits)):
            kept[pattern] = style
    return kept


def _layout(module: nn.Module) -> Optional[str]:
    for name, projections in _LAYOUTS.items():
        if all(type(getattr(module, p, None)) is nn.Linear for p in projections):
            return name
    return None


def is_gated_deltanet(module: nn.Module) -> bool:
    """A transformers gated DeltaNet layer (Qwen3-Next's, Qwen 3.5's or OLMo hybrid's): the attributes and modules its
    forward reads."""
    return (all(isinstance(module.__dict__.get(a), int) for a in _COUNTS) and _layout(module) is not None
            and isinstance(getattr(module, "conv1d", None), nn.Conv1d) and type(getattr(module, out_name(module), None))
            is nn.Linear and isinstance(getattr(module, "A_log", None), nn.Parameter)
            and isinstance(getattr(module, "dt_bias", None), nn.Parameter))


def unsupported(module: nn.Module, n: int, setting: str = "tp") -> Optional[str]:
    """Why ``module`` cannot run cut over ``n`` ranks (None when it can)."""
    kind = type(module).__name__
    nk, nv = module.num_k_heads, module.num_v_heads
    if nk % n:
        return f"{kind}: {setting}={n} does not divide its {nk} key heads"
    if nv % nk or module.key_dim != nk * module.head_k_dim or module.value_dim != nv * module.head_v_dim:
        return f"{kind}: its head counts ({nk} key, {nv} value heads) are not a gated DeltaNet layout known here"
    if module.conv1d.in_channels != module.conv_dim or module.conv1d.groups != module.conv_dim or (
            module.conv_dim != 2 * module.key_dim + module.value_dim):
        return f"{kind}: conv1d is not depthwise over [q | k | v]"
    biased = [p for p in (*_LAYOUTS[_layout(module)], out_name(module), "conv1d") if getattr(module, p).bias is not None]
    if biased:
        return f"{kind}: {', '.join(biased)} with a bias (not a layout known here)"
    norm = getattr(module, norm_name(module), None)
    if not isinstance(getattr(norm, "weight", None), nn.Parameter) or norm.weight.shape != (module.head_v_dim,):
        return f"{kind}: its norm is not one weight over head_v_dim shared by the heads"
    own = [p for p, _ in module.named_parameters(recurse=False) if p not in ("A_log", "dt_bias")]
    if own:
        return f"{kind}: parameters of its own besides A_log / dt_bias ({', '.join(own)})"
    return None


def specs(name: str, module: nn.Module, n: int) -> Dict[str, ShardSpec]:
    """The cut of every parameter over ``n`` ranks (by key-head groups); ValueError naming why it cannot be."""
    why = unsupported(module, n)
    if why is not None:
        raise ValueError(f"gated DeltaNet {name!r}: {why}")
    key, value, nv = module.key_dim, module.value_dim, module.num_v_heads
    qkv = (key, key, value)
    out = {}
    layout = _layout(module)
    if layout == "olmo":  # a projection per part: each cut by rows (whole heads)
        for proj, rows in (("q_proj", key), ("k_proj", key), ("v_proj", value), ("g_proj", value), ("b_proj", nv),
                           ("a_proj", nv)):
            out[f"{proj}.weight"] = make_spec(0, rows, n, what=f"{name}.{proj}")
    elif layout == "qkvz":  # rows grouped by key head: a contiguous cut keeps whole groups
        rows = module.in_proj_qkvz.out_features
        out["in_proj_qkvz.weight"] = make_spec(0, rows, n, what=f"{name}.in_proj_qkvz")
        out["in_proj_ba.weight"] = make_spec(0, 2 * nv, n, what=f"{name}.in_proj_ba")
    else:
        out["in_proj_qkv.weight"] = make_spec(0, sum(qkv), n, parts=qkv, what=f"{name}.in_proj_qkv")
        out["in_proj_z.weight"] = make_spec(0, value, n, what=f"{name}.in_proj_z")
        out["in_proj_b.weight"] = make_spec(0, nv, n, what=f"{name}.in_proj_b")
        out["in_proj_a.weight"] = make_spec(0, nv, n, what=f"{name}.in_proj_a")
    out["conv1d.weight"] = make_spec(0, sum(qkv), n, parts=qkv, what=f"{name}.conv1d")
    out["A_log"] = make_spec(0, nv, n, what=f"{name}.A_log")
    out["dt_bias"] = make_spec(0, nv, n, what=f"{name}.dt_bias")
    out[f"{out_name(module)}.weight"] = make_spec(1, value, n, what=f"{name}.{out_name(module)}")
    return out


def local_counts(module: nn.Module, specs: Dict[str, ShardSpec], n: int) -> Dict[Tuple[str, str], object]:
    """The counts the forward reads, as one of ``n`` ranks holding its slices sees them."""
    conv = module.conv_dim // n
    out: Dict[Tuple[str, str], object] = {
        ("", "num_v_heads"): module.num_v_heads // n, ("", "num_k_heads"): module.num_k_heads // n,
        ("", "key_dim"): module.key_dim // n, ("", "value_dim"): module.value_dim // n, ("", "conv_dim"): conv,
        ("conv1d", "in_channels"): conv, ("conv1d", "out_channels"): conv, ("conv1d", "groups"): conv,
        (out_name(module), "in_features"): module.value_dim // n}
    projections = _LAYOUTS[_layout(module)]
    for pname, spec in specs.items():
        owner, _, leaf = pname.rpartition(".")
        if leaf == "weight" and owner in projections:
            out[owner, "out_features"] = spec.local_size
    return out
