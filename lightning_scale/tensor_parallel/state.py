"""What a plan did to a model, and checkpoints: consolidate shards into the original state_dict and back.

:func:`consolidate_state_dict` returns a state_dict with the untouched model's keys and shapes
(vocabulary padding dropped, fused sections re-interleaved), so it loads into the original model
class. :func:`load_full_state_dict` is its inverse: it slices a full state_dict into this rank's
shards, which is also how a model built on ``meta`` and then split gets its weights. A *sharded*
checkpoint is simply each rank's ``model.state_dict()`` (local shapes, same keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from lightning_scale.comm import collectives
from lightning_scale.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_scale.tensor_parallel.expert_lists import foreign_keys, gather_experts, placed_lists
from lightning_scale.tensor_parallel.sharding import mark_partial_grad, merge_shards, shard_tensor, tp_spec


@dataclass
class TensorParallelState:
    """Recorded on the model as ``model._tp_state`` by ``apply_tensor_parallel``."""

    group: Any
    tp: int
    rank: int
    sequence_parallel: bool
    styles: Dict[str, str]  # module name -> style as written in the plan
    vocab_size: Optional[int] = None  # true vocabulary of a 'vocab_colwise' head (padding excluded)
    hooks: List[Any] = field(default_factory=list)
    # replicated parameters whose gradient is a per-rank partial sum (by name: .to() may swap the objects)
    partial_grad_names: List[str] = field(default_factory=list)
    # parent module name -> the SharedInput its sibling column-parallel layers use (one input-gradient reduction)
    shared_inputs: Dict[str, Any] = field(default_factory=dict)
    # experts modules the built-in plan left whole: pattern -> why (tensor_parallel.experts)
    experts_whole: Dict[str, str] = field(default_factory=dict)

    def partial_grad_params(self, model: nn.Module) -> List[torch.nn.Parameter]:
        params = [model.get_parameter(n) for n in self.partial_grad_names]
        for p in params:
            mark_partial_grad(p)
        return params

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy of the 'vocab_colwise' head's split logits (full logits never gathered)."""
        if self.vocab_size is None:
            raise ValueError("the plan has no 'vocab_colwise' head: compute the loss from the full logits")
        return vocab_parallel_cross_entropy(logits, targets, self.group, vocab_size=self.vocab_size,
                                            ignore_index=ignore_index)


def tensor_parallel_state(model: nn.Module) -> Optional[TensorParallelState]:
    """The state ``apply_tensor_parallel`` recorded on ``model``; None when it was not applied."""
    return getattr(model, "_tp_state", None)


def _group_of(model: nn.Module, group):
    if group is not None:
        return group
    state = tensor_parallel_state(model)
    if state is None:
        raise ValueError("tensor parallelism was not applied to this model (no _tp_state); pass group=")
    return state.group


@torch.no_grad()
def consolidate_state_dict(model: nn.Module, group=None, values: Optional[Dict[str, torch.Tensor]] = None
                           ) -> Dict[str, torch.Tensor]:
    """The full, unsharded state_dict (original keys and shapes) on every rank of the tp group.

    Collective: every tp rank must call it. Split tensors are all-gathered (accounted under the tag
    ``tp/consolidate``); replicated ones are copied. ``values``: this rank's local tensors by key, used in
    place of the model's own (ZeRO-3 passes its gathered masters; keys it lacks come from the model).
    """
    group = _group_of(model, group)
    n = collectives.group_size(group)
    out: Dict[str, torch.Tensor] = {}
    done: Dict[int, torch.Tensor] = {}  # tied parameters are gathered once
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in done:
            out[key] = done[id(value)]
            continue
        spec = tp_spec(value)
        local = value.detach() if values is None or key not in values else values[key].detach()
        if spec is None:
            full = local.clone()
        else:
            if spec.tp != n:
                raise ValueError(f"{key} was split for tp={spec.tp}, the group has {n} ranks")
            gathered = torch.empty((n,) + tuple(local.shape), dtype=local.dtype, device=local.device)
            collectives.all_gather(gathered.view(-1), local.reshape(-1), group, tag="tp/consolidate")
            full = merge_shards(list(gathered.unbind(0)), spec)
        done[id(value)] = out[key] = full
    if placed_lists(model):  # experts placed by ownership: every rank's, in the list's order
        out = _with_experts(out, gather_experts(model, group, values))
    return out


def _with_experts(out: Dict[str, torch.Tensor], experts: Dict[str, Dict[str, torch.Tensor]]
                  ) -> Dict[str, torch.Tensor]:
    """``out`` with each placed list's experts (``experts``: list name -> its every rank's tensors by key) where the
    list's local experts stood (the model's order)."""
    prefixes = [(f"{n}." if n else "", n) for n in sorted(experts, key=len, reverse=True)]

    def list_of(key: str):
        return next((n for p, n in prefixes if key.startswith(p) and key[len(p):].split(".", 1)[0].isdigit()), None)

    merged: Dict[str, torch.Tensor] = {}
    done = set()
    for key, value in out.items():
        name = list_of(key)
        if name is None:
            merged[key] = value
        elif name not in done:
            done.add(name)
            merged.update(experts[name])
    return merged


@torch.no_grad()
def shard_state_dict(model: nn.Module, full: Dict[str, torch.Tensor], rank: Optional[int] = None
                     ) -> Dict[str, torch.Tensor]:
    """This rank's slices of a full state_dict, keyed like ``model.state_dict()`` (no communication)."""
    state = tensor_parallel_state(model)
    rank = (state.rank if state is not None else 0) if rank is None else rank
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key not in full:
            continue
        spec = tp_spec(value)
        out[key] = full[key] if spec is None else shard_tensor(full[key], spec, rank)
    return out


def load_full_state_dict(model: nn.Module, full: Dict[str, torch.Tensor], strict: bool = True):
    """Load an unsharded state_dict (e.g. from :func:`consolidate_state_dict`) into the split model."""
    local = shard_state_dict(model, full)
    if strict:  # the experts other ranks hold (placed by ownership) are expected, and not loaded here
        unexpected = sorted(set(full) - set(local) - foreign_keys(model, full))
        if unexpected:
            raise KeyError(f"load_full_state_dict: unexpected keys {unexpected[:10]}")
    return model.load_state_dict(local, strict=strict)


def split_summary(model: nn.Module, tp: int, top: int = 3) -> Dict[str, object]:
    """After :func:`~lightning_scale.tensor_parallel.apply.apply_tensor_parallel`: how much of ``model`` tp split. ``split`` / ``total``: parameters of the
    whole model (a split one counted at its global size), ``replicated``: the largest replicated parameter groups
    as (pattern with layer indices as ``*``, parameters over all layers), largest first. A model's own ``tp_plan``
    may cover its attention only (Mixtral's and Qwen2-MoE's in transformers 5); the built-in plan adds their
    experts (:mod:`~lightning_scale.tensor_parallel.experts`) where tp can split them: ``experts_whole`` names the
    experts modules it left whole and why, ``experts_placed`` (modules, experts per rank, experts per module) the
    ones placed whole (:mod:`~lightning_scale.tensor_parallel.expert_parallel`). The startup table prints all of it."""
    from lightning_scale.tensor_parallel.plan import _generic  # one naming of layer patterns

    split = replicated = 0
    groups: Dict[str, int] = {}
    for name, prm in model.named_parameters():
        spec = tp_spec(prm)
        if spec is not None:
            split += prm.numel() // max(1, spec.local_size) * spec.size
        elif getattr(prm, "tp_owned", False):  # an expert placed by ownership: the other ranks hold the others
            split += prm.numel() * tp
        else:
            replicated += prm.numel()
            key = _generic(name)
            groups[key] = groups.get(key, 0) + prm.numel()
    total = split + replicated
    largest = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    state = getattr(model, "_tp_state", None)
    # experts placed whole by style expert_parallel: (modules, experts per rank, experts per module)
    placed = [(m.num_experts, m.num_experts * m._tp_expert_parallel) for m in model.modules()
              if getattr(m, "_tp_expert_parallel", 1) > 1]
    return {"tp": tp, "split": split, "total": total, "fraction": split / total if total else 0.0,
            "replicated": largest, "experts_whole": dict(getattr(state, "experts_whole", {}) or {}),
            "experts_placed": (len(placed), *placed[0]) if placed else None,
            # ep > 1 (expert_alltoall): the ranks hold different tokens, routes exchanged by all-to-all
            "exchanged": any(getattr(m, "_ep_exchange", False) for m in model.modules())}
