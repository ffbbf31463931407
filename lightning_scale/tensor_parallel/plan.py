"""Plan tensor parallelism for an existing, unchanged model (phase 1 of ``apply_tensor_parallel(model, plan, group)``).

A plan maps module-name patterns (``*`` = one dotted component, e.g. ``blocks.*.attn.qkv``) to styles
(:mod:`~lightning_scale.tensor_parallel.styles`). Applying it happens in two phases so a bad plan fails
before anything changes:

1. :func:`plan_tensor_parallel` (pure, needs only the tp size): match patterns, check module types,
   that tp divides every split dimension and every head count, that tied weights are split alike.
2. :func:`~lightning_scale.tensor_parallel.apply.apply_tensor_parallel`: replace the matched modules by their parallel versions in place
   (same names, so state_dict keys do not change), shrink the head counts the attention reads at run
   time, re-tie shared weights, install sequence-parallel hooks and marks, record the state.

Built-in plans (``plan=None``): the project GPT, a Hugging Face model's own ``tp_plan`` /
``base_model_tp_plan`` (with the rules of :mod:`~lightning_scale.tensor_parallel.hf_rules`), and Hugging Face
GPT-2 (fused ``Conv1D`` ``c_attn``, split per head).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.tensor_parallel import (deltanet, expert_lists, experts, grouped_attention, head_params, mamba, mla,
                                             norms)
from lightning_scale.tensor_parallel import expert_parallel as expert_parallel_style
from lightning_scale.tensor_parallel.hf import default_plan, is_hf_model
from lightning_scale.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                    dense_features, is_conv1d)
from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec
from lightning_scale.tensor_parallel.styles import Style, parse_style

HEAD_ATTRS = ("n_head", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_head", "n_kv_heads",
              "num_kv_heads", "n_query_groups")
WIDTH_ATTRS = ("split_size", "embed_dim", "hidden_size", "all_head_size", "inner_dim")
CONFIG_HEAD_ATTRS = ("num_attention_heads", "num_key_value_heads")


@dataclass
class Action:
    name: str
    module: nn.Module
    style: Style  # sections resolved
    weight_spec: Optional[ShardSpec]
    param_specs: Dict[str, ShardSpec] = field(default_factory=dict)  # 'experts': each expert weight's spec


@dataclass
class TensorParallelPlan:
    """The validated result of :func:`plan_tensor_parallel`: what apply will do, nothing done yet."""

    tp: int
    sequence_parallel: bool
    actions: List[Action]
    parent_fixes: Dict[str, Dict[str, int]]  # attention module name -> {attr: local value}
    ties: List[List[Tuple[str, str]]]  # groups of (module name, param name) sharing one tensor
    styles: Dict[str, str] = field(default_factory=dict)
    # attention module name -> {config attr: local value}: its forward reads head counts from its config
    config_views: Dict[str, Dict[str, int]] = field(default_factory=dict)
    # experts modules the built-in plan left whole (pattern -> why)
    experts_whole: Dict[str, str] = field(default_factory=dict)


def _pattern_regex(pattern: str) -> "re.Pattern":
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def _generic(name: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def _no_match_error(pattern: str, names: List[str], model: nn.Module) -> ConfigError:
    generic = sorted({_generic(n) for n in names})
    close = difflib.get_close_matches(pattern, generic + names, n=5, cutoff=0.6)
    if close:
        hint = f"did you mean: {', '.join(dict.fromkeys(close))}?"
    else:
        hint = f"module names look like: {', '.join(generic[:12])}"
    return ConfigError(f"tensor.plan: pattern {pattern!r} matches no module of {type(model).__name__}; {hint}")


def _match(model: nn.Module, plan: Dict[str, object], strict: bool) -> List[Tuple[str, nn.Module, Style]]:
    modules = {n: m for n, m in model.named_modules() if n}
    names = list(modules)
    owner: Dict[str, str] = {}
    out = []
    for pattern, value in plan.items():
        style = parse_style(value, pattern)
        rx = _pattern_regex(pattern)
        hits = [n for n in names if rx.match(n)]
        if not hits:
            if strict:
                raise _no_match_error(pattern, names, model)
            continue
        for n in hits:
            if n in owner:
                raise ConfigError(f"tensor.plan: module {n!r} is matched by both {owner[n]!r} and {pattern!r}")
            owner[n] = pattern
            out.append((n, modules[n], style))
    return out


def _parent_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _heads(module: nn.Module) -> Dict[str, int]:
    """Head counts an attention module declares (its own attributes, then its ``config``)."""
    found = {a: v for a in HEAD_ATTRS if isinstance(v := module.__dict__.get(a), int)}
    config = module.__dict__.get("config")
    if config is not None and isinstance(getattr(module, "head_dim", None), int):
        # what the module does not hold itself comes from its config (Phi3 keeps only num_key_value_heads)
        has_q, has_kv = any(not _is_kv(a) for a in found), any(_is_kv(a) for a in found)
        for a in CONFIG_HEAD_ATTRS:
            v = getattr(config, a, None)
            if isinstance(v, int) and not (has_kv if _is_kv(a) else has_q):
                found[f"config.{a}"] = v
        found = dict(sorted(found.items(), key=lambda kv: _is_kv(kv[0])))  # q heads first
    return found


def _check_module(name: str, module: nn.Module, style: Style) -> None:
    if style.kind in ("colwise", "rowwise") and not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise ConfigError(f"tensor.plan: style {style.name!r} needs nn.Linear or Conv1D; {name!r} is "
                          f"{type(module).__name__}")
    if style.kind == "vocab" and not isinstance(module, nn.Embedding):
        raise ConfigError(f"tensor.plan: style {style.name!r} needs nn.Embedding; {name!r} is {type(module).__name__}")
    if (style.kind == "vocab" and type(module).forward is not nn.Embedding.forward
            and not isinstance(getattr(module, "embed_scale", None), torch.Tensor)):
        # the parallel embedding reproduces a plain lookup (and Gemma's * embed_scale), nothing else
        raise ConfigError(f"tensor.plan: {name!r} is a {type(module).__name__} with its own forward, which the "
                          f"vocabulary-parallel embedding would not run; leave it out of the plan ('replicate')")
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
        raise ConfigError(f"tensor.plan: {name!r} is already tensor-parallel (plan applied twice?)")
    if style.kind == "norm_split" and (why := norms.unsupported(module)) is not None:
        raise ConfigError(f"tensor.plan: style {style.name!r} on {name!r}: {why}")
    if style.kind == "head_params" and (why := head_params.unsupported(module)) is not None:
        raise ConfigError(f"tensor.plan: style {style.name!r} on {name!r}: {why}")
    if style.kind == "mla_kv_a" and not isinstance(module, nn.Linear):
        raise ConfigError(f"tensor.plan: style {style.name!r} needs nn.Linear; {name!r} is {type(module).__name__}")
    if style.kind == "mamba" and (why := mamba.unsupported(module, 1, style.name)) is not None:
        raise ConfigError(f"tensor.plan: style {style.name!r} on {name!r}: {why}")
    if style.kind == "experts" and (why := experts.unsupported(module)) is not None:
        raise ConfigError(f"tensor.plan: style {style.name!r} on {name!r}: {why}")
    if style.kind in ("expert_parallel", "expert_data_parallel") and (
            why := expert_parallel_style.unsupported(module)) is not None:
        raise ConfigError(f"tensor.plan: style {style.name!r} on {name!r}: {why}")


def _is_kv(attr: str) -> bool:
    return "key_value" in attr or "kv" in attr or "query_groups" in attr


def _qkv_parts(parent: Optional[nn.Module], out_f: int, infer_head_dim: bool) -> Tuple[int, ...]:
    """Sizes of a fused ``[q | k | v]`` output of ``out_f`` features under ``parent`` (its head counts and head
    size), ``()`` when it is not one. Grouped-query parts differ: ``(H * hs, G * hs, G * hs)``. Without a
    ``head_dim`` attribute the head size is inferred only when the plan says the output is fused
    (``infer_head_dim``: style ``qkv_colwise``)."""
    heads = _heads(parent) if parent is not None else {}
    q_heads = next((v for a, v in heads.items() if not _is_kv(a)), None)
    kv_heads = next((v for a, v in heads.items() if _is_kv(a)), q_heads)
    if not q_heads:
        return ()
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) and infer_head_dim:  # litgpt's attention keeps its head size in its config
        head_dim = out_f // (q_heads + 2 * kv_heads) if out_f % (q_heads + 2 * kv_heads) == 0 else None
    if not head_dim or out_f != (q_heads + 2 * kv_heads) * head_dim:
        return ()
    return (q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)


def kv_replicas(parent: Optional[nn.Module], tp: int) -> int:
    """How many tp ranks share each kv head of ``parent``'s attention: ``tp // G`` when ``G`` kv heads are fewer
    than tp and tp is a multiple of ``G`` (and tp divides the q heads), else 1 (split or refused as usual)."""
    heads = _heads(parent) if parent is not None else {}
    q_heads = next((v for a, v in heads.items() if not _is_kv(a)), None)
    kv_heads = next((v for a, v in heads.items() if _is_kv(a)), None)
    if not q_heads or not kv_heads or kv_heads >= tp or tp % kv_heads or q_heads % tp:
        return 1
    return tp // kv_heads


def _kv_splits(parent: Optional[nn.Module], out_f: int, parts: Tuple[int, ...], tp: int) -> Tuple[int, ...]:
    """``splits`` of a colwise output that holds kv heads shared by several ranks (kv heads < tp), else ``()``:
    a fused ``[q | k | v]`` (``parts``) cuts q over tp and k, v into one piece per kv head; a separate
    ``k_proj`` / ``v_proj`` (``out_f`` = kv heads x head dim) into one piece per kv head."""
    rep = kv_replicas(parent, tp)
    if rep == 1:
        return ()
    kv_heads = tp // rep
    if parts:
        return (tp, kv_heads, kv_heads)
    head_dim = getattr(parent, "head_dim", None)
    heads = _heads(parent)
    q_heads = next(v for a, v in heads.items() if not _is_kv(a))
    if isinstance(head_dim, int) and out_f == kv_heads * head_dim and out_f != q_heads * head_dim:
        return (kv_heads,)
    return ()


def _resolve(name: str, module: nn.Module, style: Style, parent: Optional[nn.Module], tp: int) -> Action:
    """Fix fused sections and compute the weight's shard spec (ConfigError when tp does not divide)."""
    try:
        if style.kind == "vocab":
            return Action(name, module, style, make_spec(0, module.num_embeddings, tp, pad=True, what=name))
        if style.kind == "experts":
            specs = experts.expert_specs(name, module, tp)
            return Action(name, module, style, next(iter(specs.values())), specs)
        if style.kind in ("expert_parallel", "expert_data_parallel"):
            specs = expert_parallel_style.placed_specs(name, module, tp)
            if expert_lists.is_expert_list(module):  # placed by ownership: no parameter is cut
                return Action(name, module, style, specs[""], {})
            return Action(name, module, style, next(iter(specs.values())), specs)
        if style.kind == "mamba":
            specs = mamba.mixer_specs(name, module, tp)
            return Action(name, module, style, next(iter(specs.values())), specs)
        if style.kind == "norm_split":
            specs = norms.norm_specs(name, module, tp)
            return Action(name, module, style, specs["weight"], specs)
        if style.kind == "head_params":
            specs = head_params.head_specs(name, module, tp)
            return Action(name, module, style, next(iter(specs.values()), None), specs)
        if style.kind == "grouped_rows":
            specs = grouped_attention.row_specs(name, module, tp)
            return Action(name, module, style, specs["weight"], specs)
        if style.kind == "mla_kv_a":
            mla.rope_width(name, module, parent)  # checked now: a missing width is a ConfigError before anything moves
        if not style.shards_linear:
            return Action(name, module, style, None)
        in_f, out_f, transposed = dense_features(module)
        sections, parts, splits = style.sections, (), ()
        if style.kind == "colwise" and sections in (0, 3):
            parts = _qkv_parts(parent, out_f, infer_head_dim=sections == 3)
            if not sections:
                sections = 3 if parts else 1  # fused [q | k | v]: split each part by whole heads
            if sections != 3:
                parts = ()
        if style.kind == "colwise" and not style.gather_output and sections in (1, 3) and not style.pad:
            if parent is not None and _heads(parent):  # heads first: a head count names the problem best
                _check_heads(_parent_name(name), parent, tp, name)
            splits = _kv_splits(parent, out_f, parts, tp)  # kv heads < tp: each rank keeps the kv head it uses
        style = Style(style.kind, sections, style.gather_output, style.pad, style.name, style.split_input)
        if style.kind == "colwise":
            spec = make_spec(1 if transposed else 0, out_f, tp, sections=sections, pad=style.pad,
                             what=f"{name} out_features", parts=parts, splits=splits)
        else:
            spec = make_spec(0 if transposed else 1, in_f, tp, sections=sections, what=f"{name} in_features")
        return Action(name, module, style, spec)
    except ValueError as err:
        raise ConfigError(f"tensor.plan: {err}") from None


def _check_heads(pname: str, parent: nn.Module, tp: int, proj: str) -> int:
    """ConfigError naming the head count of attention ``pname`` that tp can neither split nor (kv heads)
    replicate; else the number of ranks sharing each kv head (1: none shared)."""
    rep = kv_replicas(parent, tp)
    for attr, value in _heads(parent).items():
        if value % tp and not (rep > 1 and _is_kv(attr)):
            where = f"{pname}.{attr}" if pname else attr
            hint = (f"; {value} key/value head(s) can be neither split nor replicated over tp={tp} (tp must "
                    f"divide them or be a multiple of them): use such a tp, or a plan with {proj!r} "
                    "gathered ('colwise_gather_output') and its output projection 'rowwise_split_input'"
                    ) if _is_kv(attr) else ""
            raise ConfigError(f"tp={tp} does not divide the number of heads {where}={value}{hint}")
    return rep


def _parent_fixes(model: nn.Module, actions: List[Action], tp: int) -> Dict[str, Dict[str, int]]:
    """Local head counts (and widths) for each attention module whose projections are split."""
    fixes: Dict[str, Dict[str, int]] = {}
    for act in actions:
        # Only a colwise output that stays split changes what the attention sees (its local heads); a
        # gathered one (Phi3's qkv 'colwise_gather_output') leaves every head on every rank.
        if act.style.kind != "colwise" or act.style.gather_output:
            continue
        pname = _parent_name(act.name)
        if pname in fixes:
            continue
        parent = model.get_submodule(pname)
        heads = _heads(parent)
        if not heads:
            continue
        rep = _check_heads(pname, parent, tp, act.name)
        # kv heads < tp: each rank keeps the one kv head its q heads use
        local = {a: (1 if rep > 1 and _is_kv(a) else v // tp) for a, v in heads.items()}  # config.*: for views
        if rep > 1 and isinstance(parent.__dict__.get("num_key_value_groups"), int):  # HF: q heads per local kv head
            local["num_key_value_groups"] = next(v for a, v in heads.items() if not _is_kv(a)) // tp
        head_dim = getattr(parent, "head_dim", None)
        q_heads = next(iter(heads.values()))
        for attr in WIDTH_ATTRS:
            value = parent.__dict__.get(attr)
            if isinstance(value, int) and isinstance(head_dim, int) and value == q_heads * head_dim:
                local[attr] = value // tp
        fixes[pname] = local
    return fixes


def _ties(model: nn.Module, actions: List[Action]) -> List[List[Tuple[str, str]]]:
    """Parameters shared by several modules must be split identically (or not at all)."""
    owners: Dict[int, List[Tuple[str, str]]] = {}
    for mname, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mname, pname))
    by_name = {a.name: a for a in actions}
    groups = []
    for group in owners.values():
        if len(group) < 2:
            continue
        specs = [(by_name[m].weight_spec if m in by_name and p == "weight" else None) for m, p in group]
        if any(s != specs[0] for s in specs):
            listed = ", ".join(f"{m}.{p}" for m, p in group)
            raise ConfigError(f"tensor.plan: tied parameter {listed} must be split the same way in every module "
                              f"that shares it (e.g. 'vocab' + 'vocab_colwise')")
        if specs[0] is not None:
            groups.append(group)
    return groups


def plan_tensor_parallel(model: nn.Module, plan: Optional[Dict[str, object]], tp: int, *,
                         sequence_parallel: bool = False, expert_parallel: bool = False) -> TensorParallelPlan:
    """Validate ``plan`` against ``model`` for a tp group of size ``tp``; changes nothing (pure).
    ``expert_parallel``: the experts modules the plan gives style ``experts`` (the built-in plans do) get
    ``expert_parallel`` instead: whole experts placed on the tp ranks."""
    if getattr(model, "_tp_state", None) is not None:
        raise ConfigError("tensor.plan: tensor parallelism is already applied to this model (plan applied twice)")
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp!r} must be a positive integer")
    strict = plan is not None
    views: set = set()
    whole: Dict[str, str] = {}
    if plan is None:
        plan = default_plan(model, sequence_parallel)
        if is_hf_model(model) and tp > 1:
            from lightning_scale.tensor_parallel.hf_rules import (head_left_out, mla_left_out, mlps_left_out,
                                                                  scalars_on_split_features, split_gathered_pairs)

            plan, views = split_gathered_pairs(model, plan, tp)
            patterns = [_pattern_regex(p) for p in plan]
            add, whole = experts.expert_plan_entries(model, lambda n: any(rx.match(n) for rx in patterns), tp,
                                                     placed=expert_parallel)
            plan.update(add)
            plan.update(mlps_left_out(model, plan, tp))
            plan.update(mla_left_out(model, plan, tp))  # Kimi Linear's latent attention, which its plan leaves whole
            patterns = [_pattern_regex(p) for p in plan]  # DeepSeek-V4's attention, which its plan leaves whole
            plan.update(grouped_attention.attention_entries(model, lambda n: any(rx.match(n) for rx in patterns), tp))
            plan.update(head_left_out(model, plan))
            plan = deltanet.released_projections(model, plan, tp)  # their declared gathers give way to the region
            patterns = [_pattern_regex(p) for p in plan]
            mixers, mixers_whole = mamba.mixer_plan_entries(model, lambda n: any(rx.match(n) for rx in patterns), tp)
            plan.update(mixers)
            whole.update(mixers_whole)
            plan.update(scalars_on_split_features(model, plan))
    if sequence_parallel and is_hf_model(model):
        raise ConfigError("tensor.sequence_parallel=True is supported for the project GPT only: Hugging Face "
                          "models derive positions and masks from the hidden states' sequence length")
    actions = []
    for name, module, style in _match(model, plan, strict):
        if expert_parallel and style.kind == "experts" and expert_lists.is_routable(module):
            actions.extend(_placed_block(name, module, tp))
            continue
        if expert_parallel and style.kind in ("experts", "expert_parallel") and expert_lists.is_expert_list(module):
            actions.append(_placed_list(name, module, tp))  # a user's plan naming the ExpertList itself
            continue
        if expert_parallel and style.kind == "experts":
            if not experts.is_experts(module):
                raise ConfigError(f"tensor.expert_parallel=True: {name!r}: {expert_parallel_style.unsupported(module)}")
            style = parse_style("expert_parallel")
        _check_module(name, module, style)
        parent = model.get_submodule(_parent_name(name)) if "." in name else model
        actions.append(_resolve(name, module, style, parent, tp))
    if not any(a.weight_spec is not None for a in actions):
        raise ConfigError(f"tensor.plan: no module of {type(model).__name__} is split by the plan")
    if expert_parallel and not any(a.style.kind == "expert_parallel" for a in actions):
        why = "; ".join(f"{p}: {w}" for p, w in whole.items()) or "it has no transformers experts module"
        raise ConfigError(f"tensor.expert_parallel=True: no experts of {type(model).__name__} can be placed on the "
                          f"tp ranks ({why})")
    if sequence_parallel:
        _check_sequence_parallel(model, actions)
    fixes = _parent_fixes(model, actions, tp)
    config_views = {n: {a.split(".", 1)[1]: v for a, v in fixes.get(n, {}).items() if a.startswith("config.")}
                    for n in views}
    return TensorParallelPlan(tp=tp, sequence_parallel=sequence_parallel, actions=actions,
                              parent_fixes={n: {a: v for a, v in f.items() if not a.startswith("config.")}
                                            for n, f in fixes.items()},
                              ties=_ties(model, actions), styles={a.name: a.style.name for a in actions},
                              config_views=config_views, experts_whole=whole)


def _placed_list(name: str, experts_list: nn.Module, tp: int) -> Action:
    """An :class:`~lightning_scale.tensor_parallel.expert_lists.ExpertList` placed on the tp ranks by ownership."""
    try:
        spec = make_spec(0, len(experts_list), tp, what=f"the number of experts of {name}")
    except ValueError as err:
        raise ConfigError(f"tensor.expert_parallel=True: {err}") from None
    return Action(name, experts_list, parse_style("expert_parallel"), spec, {})


def _placed_block(name: str, block: nn.Module, tp: int) -> List[Action]:
    """A MoE block calling its experts list on routes (litgpt's, routed by :func:`apply_tensor_parallel`, or a
    user's :class:`~lightning_scale.tensor_parallel.expert_lists.ExpertList`) under ``tensor.expert_parallel``: the
    list placed by ownership, its shared expert split column / row-wise when tp divides its width (else left whole
    on every rank)."""
    out = [_placed_list(f"{name}.experts", block.experts, tp)]
    shared = getattr(block, "shared_experts", None)
    layout = experts._mlp_layout(shared) if shared is not None else None
    if layout is not None and all(getattr(shared, u).out_features % tp == 0 for u in layout[0]):
        for attr, kind in [(u, "colwise") for u in layout[0]] + [(layout[1], "rowwise")]:
            out.append(_resolve(f"{name}.shared_experts.{attr}", getattr(shared, attr), parse_style(kind), shared, tp))
    return out


def _check_sequence_parallel(model: nn.Module, actions: List[Action]) -> None:
    """Activations enter the sequence-sharded region at the embeddings: both must be planned for it."""
    kinds = {a.name: a.style.kind for a in actions}
    if "vocab" not in kinds.values() and "sequence_split" not in kinds.values():
        raise ConfigError("tensor.sequence_parallel=True needs the input embedding split ('vocab') or the "
                          "first sequence-sharded module marked 'sequence_split'")
    check = getattr(model, "check_tensor_parallel_plan", None)  # the model's own rules (the project GPT's)
    if callable(check):
        try:
            check(kinds, True)
        except ValueError as err:
            raise ConfigError(str(err)) from None
