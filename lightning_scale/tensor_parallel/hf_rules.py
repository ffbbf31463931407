"""Hugging Face rules :func:`~lightning_scale.tensor_parallel.plan.plan_tensor_parallel` adds to a model's own
``tp_plan`` (``plan=None``, tp > 1): fused projections kept split across a gathered pair, and trainable scalars
beside split features summed over tp. Pure: they return plan entries; nothing changes the model."""

from __future__ import annotations

from typing import Dict, Tuple

import torch.nn as nn

from lightning_scale.tensor_parallel.plan import (_generic, _heads, _is_kv, _parent_name, _pattern_regex, _qkv_parts,
                                                  kv_replicas)
from lightning_scale.tensor_parallel.styles import parse_style

_GATHERED = ("colwise_gather_output", "colwise_rep")
_SPLIT_INPUT = ("rowwise_split_input", "rowwise_rep")


def split_gathered_pairs(model: nn.Module, plan: Dict[str, object], tp: int) -> Tuple[Dict[str, object], set]:
    """A Hugging Face plan's ``colwise_gather_output`` projection feeding a ``rowwise_split_input`` one inside the
    same module (Phi3's fused ``qkv_proj`` -> ``o_proj`` and ``gate_up_proj`` -> ``down_proj``) kept split instead:
    the fused output cut per part (``qkv_colwise``: ``[q_r | k_r | v_r]``; ``packed_colwise``: ``[gate_r | up_r]``)
    and the second projection plain ``rowwise``. Same math, without the all-gather of the activations and the
    input split in between. Only where tp splits (or, kv heads, replicates) every part; otherwise the declared
    gathered styles stay. Returns the plan and the attention modules whose forward reads head counts from their
    config (they get a per-rank view of it)."""
    modules = dict(model.named_modules())
    out, views = dict(plan), set()
    names = {p: getattr(v, "name", v) for p, v in plan.items()}  # the built-in plans hold Style objects
    for pattern, style in names.items():
        if style not in _GATHERED or "." not in pattern:
            continue
        parent_pat = pattern.rsplit(".", 1)[0]
        sibling = next((p for p, v in names.items() if v in _SPLIT_INPUT and p.rsplit(".", 1)[0] == parent_pat), None)
        rx = _pattern_regex(pattern)
        hits = [n for n in modules if rx.match(n)]
        if sibling is None or not hits or not all(isinstance(modules[n], nn.Linear) for n in hits):
            continue
        parent = modules[_parent_name(hits[0])]
        out_f = modules[hits[0]].out_features
        second = next(m for n, m in modules.items() if _pattern_regex(sibling).match(n))
        parts = _qkv_parts(parent, out_f, infer_head_dim=False)
        if parts:
            heads = _heads(parent)
            q = next(v for a, v in heads.items() if not _is_kv(a))
            kv = next((v for a, v in heads.items() if _is_kv(a)), q)
            if q % tp or (kv % tp and kv_replicas(parent, tp) == 1) or second.in_features != parts[0]:
                continue
            out[pattern], out[sibling] = "qkv_colwise", "rowwise"
            views.update(_parent_name(n) for n in hits)
        elif isinstance(second, nn.Linear) and out_f == 2 * second.in_features and second.in_features % tp == 0:
            out[pattern], out[sibling] = "packed_colwise", "rowwise"
    return out, views


def scalars_on_split_features(model: nn.Module, plan: Dict[str, object]) -> Dict[str, str]:
    """``{pattern: 'replicated_with_grad_allreduce'}`` for every module the plan leaves out that sits beside a
    column- and a row-parallel sibling (an MLP between its split up and down projections) and holds only trainable
    scalars: an activation with parameters, Apertus' xIELU (``alpha_p``, ``alpha_n``). It runs on each rank's slice
    of the features, so each rank's gradient of its scalars is a partial sum; left whole, the ranks' copies drift
    apart, silently (transformers' own Apertus plan misses it: 9.4e-7 off one process after 3 float64 steps at tp=2).
    Summed over tp in the backward, they stay one process's. Modules holding larger parameters are left as the plan
    says (a per-head norm: the plan names it; a norm over the split features needs style 'rmsnorm_split')."""
    rules = [(_pattern_regex(p), parse_style(v, p).kind) for p, v in plan.items()]
    out: Dict[str, str] = {}
    for pname, parent in model.named_modules():
        kinds = {}
        for cname, _ in parent.named_children():
            full = f"{pname}.{cname}" if pname else cname
            kinds[cname] = next((k for rx, k in rules if rx.match(full)), None)
        if "colwise" not in kinds.values() or "rowwise" not in kinds.values():
            continue
        for cname, child in parent.named_children():
            params = [p for p in child.parameters() if p.requires_grad]
            if kinds[cname] is None and params and all(p.numel() == 1 for p in params):
                out[_generic(f"{pname}.{cname}" if pname else cname)] = "replicated_with_grad_allreduce"
    return out


# an MLP whose up projection is fused ``[gate | up]`` (Granite 4's shared_mlp): (the fused up, the down projection)
_PACKED_MLPS = (("input_linear", "output_linear"),)


def _packed_mlp(module: nn.Module):
    for up, down in _PACKED_MLPS:
        u, d = getattr(module, up, None), getattr(module, down, None)
        if type(u) is nn.Linear and type(d) is nn.Linear and u.out_features == 2 * d.in_features:
            return (up,), down
    return None


def mlps_left_out(model: nn.Module, plan: Dict[str, object], tp: int) -> Dict[str, str]:
    """``{pattern: style}`` for every MLP of linear layers a Hugging Face model's plan leaves out entirely (no entry for
    it, its projections or a module above it): the up projections ``colwise`` (a fused ``[gate | up]``:
    ``packed_colwise``), the down projection ``rowwise``. Exact for any such MLP (its input whole on every rank, the
    activation elementwise, the down projection's partial outputs all-reduced). The dense layers of hybrid families
    whose declared plans split attention only (Jamba's, Falcon-H1's, LFM2's MLPs, Granite 4's shared MLP: 75% of that
    model) stayed whole on every rank. Left out: an MLP holding other parameters between its projections (a norm over
    the intermediate), one in an experts list (its block's style decides), a width tp does not divide."""
    from lightning_scale.tensor_parallel.experts import _mlp_layout

    rules = [_pattern_regex(p) for p in plan]

    def covered(name: str) -> bool:
        return any(rx.match(name) for rx in rules)

    out: Dict[str, str] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        layout, packed = _mlp_layout(module), None
        if layout is None:
            layout = packed = _packed_mlp(module)
        if layout is None:
            continue
        ups, down = layout
        parts = name.split(".")
        if "experts" in parts or any(covered(".".join(parts[:i])) for i in range(1, len(parts) + 1)):
            continue
        if any(covered(f"{name}.{n}") for n in (*ups, down)):
            continue
        holders = {n for n, c in module.named_children() if any(True for _ in c.parameters())}
        if holders - {*ups, down} or getattr(module, down).in_features % tp:
            continue
        for n in ups:  # by name: a hybrid's layers may hold another module under the same attribute (Nemotron-H's mixer)
            out[f"{name}.{n}"] = "packed_colwise" if packed else "colwise"
        out[f"{name}.{down}"] = "rowwise"
    return out


def head_left_out(model: nn.Module, plan: Dict[str, object]) -> Dict[str, str]:
    """``{head: 'colwise_gather_output'}`` when a Hugging Face model's plan leaves its untied LM head out (Nemotron-H's
    declares its embedding and attention only: its head, whole on every rank, was the largest replicated weight); the
    logits gathered as transformers' own plans do, so the model's loss runs unchanged."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear:
        return {}
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    if emb is not None and getattr(emb, "weight", None) is head.weight:
        return {}  # tied: split (or not) with the embedding, as the plan says
    name = next(n for n, m in model.named_modules() if m is head)
    if any(_pattern_regex(p).match(name) for p in plan):
        return {}
    return {name: "colwise_gather_output"}


def mla_left_out(model: nn.Module, plan: Dict[str, object], tp: int) -> Dict[str, str]:
    """``{name: style}`` for every multi-head latent attention a Hugging Face model's plan leaves out entirely (Kimi
    Linear's: its declared plan covers its MLPs and experts only): DeepSeek-V3's own plan for it, by name (the query
    ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` by heads, ``kv_a_proj_with_mqa`` whole with its rotary key's gradient
    summed over tp, ``o_proj`` by rows). Left out: an attention whose heads tp does not divide."""
    rules = [_pattern_regex(p) for p in plan]

    def covered(name: str) -> bool:
        return any(rx.match(name) for rx in rules)

    out: Dict[str, str] = {}
    for name, module in model.named_modules():
        query = next((q for q in ("q_b_proj", "q_proj") if type(getattr(module, q, None)) is nn.Linear), None)
        if not name or query is None or not all(
                type(getattr(module, n, None)) is nn.Linear for n in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")):
            continue
        heads = getattr(module, "num_heads", None) or getattr(getattr(module, "config", None),
                                                               "num_attention_heads", None)
        if not isinstance(heads, int) or heads % tp:
            continue
        names = (query, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
        if covered(name) or any(covered(f"{name}.{n}") for n in names):
            continue
        out.update({f"{name}.{query}": "colwise", f"{name}.kv_a_proj_with_mqa": "mla_kv_a_proj",
                    f"{name}.kv_b_proj": "colwise", f"{name}.o_proj": "rowwise"})
    return out
