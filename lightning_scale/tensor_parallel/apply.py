"""Apply a tensor-parallel plan (phase 2 of :mod:`~lightning_scale.tensor_parallel.plan`): replace the matched
modules by their parallel versions in place (same names, so state_dict keys do not change), shrink the head counts
the attention reads at run time, re-tie shared weights, install the sequence-parallel hooks and marks, share the
input-gradient reduction of sibling column-parallel layers, and record the state."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from lightning_scale.tensor_parallel import expert_alltoall
from lightning_scale.tensor_parallel import expert_parallel as expert_parallel_style
from lightning_scale.tensor_parallel import expert_lists, experts, grads, grouped_attention, head_params, mamba, mla, norms
from lightning_scale.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_scale.tensor_parallel.hf import LocalHeadsConfig
from lightning_scale.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, SharedInput,
                                                    VocabParallelEmbedding)
from lightning_scale.tensor_parallel.mappings import (gather_from_sequence_region, scatter_to_sequence_region, tp_rank,
                                                      tp_size)
from lightning_scale.tensor_parallel.plan import Action, _parent_name, plan_tensor_parallel
from lightning_scale.tensor_parallel.routed_experts import route_experts
from lightning_scale.tensor_parallel.sharding import mark_partial_grad, tp_partial_grad, tp_replicated, tp_spec
from lightning_scale.tensor_parallel.state import TensorParallelState


def _build(act: Action, group, sp: bool, gathered: bool) -> Optional[nn.Module]:
    style = act.style
    if style.kind == "vocab":
        return VocabParallelEmbedding.from_dense(act.module, group, sequence_parallel=sp, name=act.name)
    if style.kind == "colwise":
        return ColumnParallelLinear.from_dense(act.module, group, gather_output=style.gather_output,
                                               sections=style.sections, pad=style.pad, sequence_parallel=sp,
                                               input_gathered=gathered, name=act.name,
                                               parts=act.weight_spec.parts, splits=act.weight_spec.splits)
    if style.kind == "rowwise":
        return RowParallelLinear.from_dense(act.module, group, sections=style.sections, sequence_parallel=sp,
                                            input_is_parallel=not style.split_input, name=act.name)
    return None


def _sequence_split_hook(group, tag: str):
    def hook(module, args, output):  # (*, T, C) -> (*, T/tp, C)
        return scatter_to_sequence_region(output, group, dim=-2, tag=tag)

    return hook


def _sequence_gather_hook(group, tag: str, name: str):
    def hook(module, args):  # first input (*, T/tp, C) -> (*, T, C); backward reduce-scatters
        if not args or not isinstance(args[0], torch.Tensor):
            raise ValueError(f"'sequence_gather' module {name!r} must get its activations as first positional "
                             f"argument")
        return (gather_from_sequence_region(args[0], group, dim=-2, tag=tag),) + tuple(args[1:])

    return hook


def _share_sibling_inputs(model: nn.Module, state: TensorParallelState, group, sequence_parallel: bool) -> None:
    """Column-parallel layers under one parent (HF ``q_proj`` / ``k_proj`` / ``v_proj``, ``gate_proj`` /
    ``up_proj``; litgpt ``fc_1`` / ``fc_2``) get one :class:`SharedInput`: when they read the same tensor, its
    gradient is reduced over tp once (Megatron's ``f``) instead of once per layer. Found from the plan's result
    (which children are column-parallel), not from names; the parent's forward hooks bound the cache."""
    siblings: Dict[str, List[ColumnParallelLinear]] = {}
    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear) and "." in name and not module.input_gathered and module.tp > 1:
            siblings.setdefault(_parent_name(name), []).append(module)
    for pname, layers in siblings.items():
        if len(layers) < 2:
            continue
        share = SharedInput(group, f"tp/{pname}.input", sequence_parallel)
        for layer in layers:
            layer.shared_input = share
        parent = model.get_submodule(pname)
        state.hooks.append(parent.register_forward_pre_hook(share.clear))
        state.hooks.append(parent.register_forward_hook(share.clear, always_call=True))
        state.shared_inputs[pname] = share


def apply_tensor_parallel(model: nn.Module, plan: Optional[Dict[str, object]] = None, group=None, *,
                          sequence_parallel: bool = False, share_inputs: bool = True,
                          expert_parallel: bool = False) -> nn.Module:
    """Split ``model`` in place over the tp process ``group`` following ``plan`` (None: built-in plan).

    Every rank of ``group`` must call it on an identical model (same seed or same checkpoint); each
    keeps only its shards. ``share_inputs=False`` keeps one input-gradient reduction per column-parallel layer
    (see :func:`_share_sibling_inputs`; for comparisons). Returns the model. Afterwards: ``model(...)`` runs
    tensor-parallel, the project GPT's ``model.loss`` uses the vocabulary-parallel cross-entropy, and
    :func:`~lightning_scale.tensor_parallel.state.tensor_parallel_state` describes what was done.
    """
    route_experts(model)  # Llama 4's dense experts routed (same math), so they split or place like Mixtral's
    if expert_parallel:
        expert_lists.route_blocks(model)  # litgpt's MoE blocks call their experts list on routes, placed below
    tp = tp_size(group)
    p = plan_tensor_parallel(model, plan, tp, sequence_parallel=sequence_parallel, expert_parallel=expert_parallel)
    state = TensorParallelState(group=group, tp=tp, rank=tp_rank(group), sequence_parallel=sequence_parallel,
                                styles=p.styles)
    split_modules = set()
    replicated_in_region: set = set()  # gradients already complete (all-reduced in the backward)
    gathering = [a.name + "." for a in p.actions if a.style.kind == "sequence_gather"] if sequence_parallel else []
    for act in p.actions:
        new = _build(act, group, sequence_parallel, any(act.name.startswith(g) for g in gathering))
        if new is not None:
            model.set_submodule(act.name, new)
            if act.style.kind == "colwise" and act.style.pad and not act.style.gather_output:
                state.vocab_size = act.weight_spec.size
        elif act.style.kind == "sequence_split" and sequence_parallel:
            state.hooks.append(act.module.register_forward_hook(_sequence_split_hook(group, f"tp/{act.name}")))
            split_modules.add(act.name)
        elif act.style.kind == "sequence_gather" and sequence_parallel:
            hook = _sequence_gather_hook(group, f"tp/{act.name}", act.name)
            state.hooks.append(act.module.register_forward_pre_hook(hook))
        elif act.style.kind == "experts":
            state.hooks.extend(experts.split_experts(act.name, act.module, act.param_specs, group))
        elif act.style.kind == "mamba":
            state.hooks.extend(mamba.split_mixer(act.name, act.module, act.param_specs, group))
        elif act.style.kind == "expert_parallel":
            state.hooks.extend(expert_parallel_style.place_experts(act.name, act.module, act.param_specs, group))
        elif act.style.kind == "expert_data_parallel":
            state.hooks.extend(expert_alltoall.place_experts_exchanged(act.name, act.module, act.param_specs, group))
        elif act.style.kind == "norm_split":
            state.hooks.extend(norms.split_norm(act.name, act.module, act.param_specs, group))
        elif act.style.kind == "head_params":
            state.hooks.extend(head_params.split_head_params(act.name, act.module, act.param_specs, group))
        elif act.style.kind == "grouped_rows":
            parent = model.get_submodule(_parent_name(act.name)) if "." in act.name else None
            state.hooks.extend(grouped_attention.split_rows(act.name, act.module, act.param_specs, group, parent))
        elif act.style.kind == "shared_output":
            state.hooks.append(grouped_attention.install_shared_output(act.module, group, f"tp/{act.name}"))
        elif act.style.kind == "mla_kv_a":
            parent = model.get_submodule(_parent_name(act.name)) if "." in act.name else None
            rope = mla.rope_width(act.name, act.module, parent)
            state.hooks.append(mla.install(act.module, group, f"tp/{act.name}", rope))
        elif act.style.kind == "grad_allreduce":
            state.hooks.extend(grads.install_grad_allreduce(act.module, group, f"tp/{act.name}"))
            replicated_in_region.update(id(prm) for prm in act.module.parameters())
    for pname, attrs in p.parent_fixes.items():
        parent = model.get_submodule(pname)
        for attr, value in attrs.items():
            setattr(parent, attr, value)  # the attention reads these at run time (view(B, T, H_local, D))
    for pname, attrs in p.config_views.items():
        parent = model.get_submodule(pname)
        parent.config = LocalHeadsConfig(parent.config, attrs)  # Phi3: query_pos = config.num_attention_heads * D
    for group_ in p.ties:
        first = getattr(model.get_submodule(group_[0][0]), group_[0][1])
        for mname, pname in group_[1:]:
            setattr(model.get_submodule(mname), pname, first)
    if share_inputs:
        _share_sibling_inputs(model, state, group, sequence_parallel)
    if sequence_parallel:
        _mark_sequence_parallel_partials(model, split_modules, replicated_in_region)
    if any(a.style.kind == "expert_data_parallel" for a in p.actions):
        for prm in model.parameters():  # the group's ranks hold different tokens: every whole parameter's gradient
            if tp_replicated(prm):  # is this rank's share, summed over the group before the dp reduction
                mark_partial_grad(prm)
    state.partial_grad_names = [n for n, prm in model.named_parameters() if tp_partial_grad(prm)]
    state.experts_whole = dict(p.experts_whole)
    model._tp_state = state
    _patch_gpt_loss(model, state)
    return model


def _mark_sequence_parallel_partials(model: nn.Module, split_modules, complete=frozenset()) -> None:
    """Replicated params used on sequence-sharded activations (LayerNorms, row biases) get partial grads.

    Modules cut by a ``sequence_split`` hook are excluded: the hook's backward all-gathers their gradient.
    """
    skip = {id(p) for n in split_modules for p in model.get_submodule(n).parameters()} | set(complete)
    for param in model.parameters():
        if tp_spec(param) is None and id(param) not in skip:
            mark_partial_grad(param)


def _patch_gpt_loss(model: nn.Module, state: TensorParallelState) -> None:
    """A model that declares ``vocab_parallel_loss`` (the project GPT) computes ``loss(idx, targets)`` from its
    logits: with a 'vocab_colwise' head they are split, so the loss becomes the vocabulary-parallel one."""
    if getattr(model, "vocab_parallel_loss", False) and state.vocab_size is not None:
        def cross_entropy(logits, targets, reduction="mean"):  # the logits live only here: the loss may overwrite them
            return vocab_parallel_cross_entropy(logits, targets, state.group, vocab_size=state.vocab_size,
                                                inplace=True, reduction=reduction)

        def loss(idx, targets):  # chunked above the model's loss_chunk, except under sequence parallelism (the
            # head's input is then split over the sequence, which the chunks would cut across)
            return type(model).loss(model, idx, targets, cross_entropy=cross_entropy,
                                    chunk=0 if state.sequence_parallel else None)

        model.loss = loss
