"""Expert parallelism over the tp group: each tp rank holds ``E / tp`` whole experts of a mixture-of-experts layer.

Style ``expert_parallel`` (``Zero3DStrategy(tp=N, expert_parallel=True)`` gives it to every experts module of a
Hugging Face model's built-in plan) is the other way to share a transformers experts module (``MixtralExperts``,
``Qwen2MoeExperts``, ... : 3-D ``gate_up_proj`` / ``down_proj``, optional per-expert biases) over tp than style
``experts`` (:mod:`lightning_scale.tensor_parallel.experts`, every expert's intermediate width cut over tp): rank
``r`` keeps experts ``[r * E / tp, (r + 1) * E / tp)`` whole (every per-expert parameter cut along dim 0, the expert
axis). The ranks of a tp group hold the same tokens, so no token moves between ranks: the router stays whole and
routes alike on every rank, and each rank hands its experts only the routes to them, one per row (the hidden state
of a token once per local route, ``(R, 1)`` local expert ids and routing weights), so no route to another rank's
experts is computed or masked. Each route's weighted output is added to its token's row, and one all-reduce of the
module's output sums the ranks' rows, as style ``experts`` does. Backward: the gradients of the hidden states and of
the routing weights are partial on each rank (only its routes) and are all-reduced (``copy_to_region``). Any
``experts_implementation`` runs (eager, ``batched_mm``, ``grouped_mm``): they see a plain call with top-1 routing.

Why a user picks it over ``experts``: each expert's matmuls keep their full width (``I`` instead of ``I / tp``:
larger, more efficient GEMMs, the reason Megatron prefers expert parallelism for many small experts), a rank loops
over ``E / tp`` experts instead of ``E``, and experts ``experts`` cannot split are placed (per-expert biases: each
bias lives on one rank and is added once; a norm after each expert; an intermediate width tp does not divide).
The cost: a rank's work follows the router (imbalanced routing makes the busiest rank set the pace), and ``E`` must
be a multiple of tp. With top-2 routing the sum is exact (a token's two expert outputs meet once, as in one
process); with more routes per token, up to the order of the sum.

litgpt's ``LLaMAMoE`` (a *block* holding its router and a list of MLP experts, parameters named per expert) is placed
too, by ownership: its experts list keeps this rank's experts under their own names
(:mod:`~lightning_scale.tensor_parallel.expert_lists`), and so is a user's block that calls a
:class:`lightning_scale.nn.ExpertList` on routes. Not placed (ConfigError at plan time): another MoE block of
``nn.Linear`` experts (a plain ``experts`` ModuleList: its forward is not known here; make it an ``ExpertList`` or
split it with ``experts``), and
an experts module without an integer ``num_experts`` (the count its forward reads expert ids by).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from lightning_scale.tensor_parallel import expert_lists
from lightning_scale.tensor_parallel import experts as split_style
from lightning_scale.tensor_parallel.mappings import copy_to_region, reduce_from_region, tp_rank, tp_size
from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec


def unsupported(module: nn.Module) -> Optional[str]:
    """Why ``expert_parallel`` cannot place ``module``'s experts (None when it can)."""
    kind = type(module).__name__
    if expert_lists.is_expert_list(module):
        return None
    if split_style.is_moe_block(module) or expert_lists.loops_over_a_plain_list(module):
        return (f"{kind} is a mixture-of-experts block whose experts are a plain nn.ModuleList looped over in a "
                f"forward not known here (litgpt's LLaMAMoE is placed): hold them in a lightning_scale.nn.ExpertList "
                f"and call it on the router's choices (experts(x, ids, weights), docs/models.md), or split every "
                f"expert over tp with style 'experts' (tensor.expert_parallel=False)")
    if split_style.is_fused_experts(module):
        return (f"{kind} keeps every expert in 2-D w1 / v1 / w2 rows (DBRX) and its forward indexes them by the global "
                f"expert id: its experts cannot be placed (expert_parallel, ep); split every expert over tp instead "
                f"(tp > 1: the built-in plan's style 'experts')")
    if not split_style.is_experts(module):
        return (f"{kind} is not a transformers experts module (3-D gate_up_proj / down_proj weights with the layout "
                f"use_experts_implementation records)")
    if not isinstance(getattr(module, "num_experts", None), int) or isinstance(module.num_experts, bool):
        return f"{kind} has no integer num_experts (the expert count its forward reads expert ids by)"
    return None


def placed_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    """The shard spec (dim 0, the expert axis) of every parameter of ``module`` over ``tp`` ranks; ValueError naming
    the expert count tp does not divide, or why the module cannot be placed."""
    why = unsupported(module)
    if why is not None:
        raise ValueError(f"style 'expert_parallel' on {name!r}: {why}")
    if expert_lists.is_expert_list(module):  # placed by ownership: no parameter is cut (the spec is the list's)
        return {"": make_spec(0, len(module), tp, what=f"the number of experts of {name!r}")}
    n = module.num_experts
    specs: Dict[str, ShardSpec] = {}
    for pname, p in module.named_parameters(recurse=False):
        if p.dim() < 1 or p.shape[0] != n:
            raise ValueError(f"style 'expert_parallel' on {name!r}: parameter {pname} {tuple(p.shape)} is not one "
                             f"entry per expert ({n} experts)")
        specs[pname] = make_spec(0, n, tp, what=f"the number of experts of {name!r} ({pname})")
    if not specs:
        raise ValueError(f"style 'expert_parallel' on {name!r}: no parameters to place")
    return specs


class CallArgs:
    """A forward pre-hook's positional and keyword arguments, each read and replaced by its position or name."""

    def __init__(self, args, kwargs) -> None:
        self.args, self.kwargs = list(args), kwargs

    def get(self, key):
        return self.args[key] if isinstance(key, int) else self.kwargs[key]

    def put(self, key, value) -> None:
        if isinstance(key, int):
            self.args[key] = value
        else:
            self.kwargs[key] = value


def _routing(args, kwargs, name: str):
    """(key of the expert ids, keys of the routing weights, keys of the per-token inputs) among a call's arguments
    (a position or a keyword): the one integer tensor ``(T, k)``, the floating tensors of its shape, and the other
    floating tensors with ``T`` rows (the hidden states)."""
    items = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    ids = [k for k, t in items if isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()]
    if len(ids) != 1:
        raise ValueError(f"expert-parallel experts {name!r}: expected one integer tensor of expert ids among its "
                         f"arguments, found {len(ids)}")
    index = dict(items)[ids[0]]
    floats = [(k, t) for k, t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]
    weights = [k for k, t in floats if t.shape == index.shape]
    rows = [k for k, t in floats if k not in weights and t.dim() >= 1 and t.shape[0] == index.shape[0]]
    if index.dim() != 2 or not weights or not rows:
        raise ValueError(f"expert-parallel experts {name!r}: expected (hidden states (T, H), expert ids (T, k), "
                         f"routing weights (T, k)), got shapes {[tuple(t.shape) for _, t in items]}")
    return ids[0], weights, rows


def local_routes(index: torch.Tensor, first: int, local: int):
    """(token, slot) of every route of ``index`` (T, k) to experts ``[first, first + local)``, and those routes'
    local expert ids (R,)."""
    mine = (index >= first) & (index < first + local)
    token, slot = mine.nonzero(as_tuple=True)
    return token, slot, index[token, slot] - first


@torch.compiler.disable
@torch.no_grad()
def _count(module: nn.Module, index: torch.Tensor, local: int) -> None:
    """Routes per tp rank, added on the ids' device (read by :func:`route_load`; every rank routes alike, so each
    counts them all, no message)."""
    load = torch.bincount(index.flatten() // local, minlength=module._tp_expert_parallel)
    module._ep_load = load if module._ep_load is None else module._ep_load + load


def _enter(group, tag: str, name: str, first: int, local: int):
    """The experts see only this rank's routes, one per row: ``(R, H)`` hidden states (a token's row once per local
    route), ``(R, 1)`` local expert ids and weights. No route to another rank's experts reaches them, so none is
    computed or masked (transformers' sentinel ids are not used)."""

    def hook(module, args, kwargs):
        call = CallArgs(args, kwargs)
        get, put, args = call.get, call.put, call.args

        # every floating input that carries a gradient (hidden states, routing weights): partial here (this rank's
        # routes only), summed over tp; entered before the routes are picked, so the sum sees every rank's routes
        for k in list(range(len(args))) + list(kwargs):
            t = get(k)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                put(k, copy_to_region(t, group, tag=tag))
        id_key, weight_keys, row_keys = _routing(args, kwargs, name)
        index = get(id_key)
        _count(module, index, local)
        token, slot, ids = local_routes(index, first, local)
        put(id_key, ids.unsqueeze(1))
        for k in weight_keys:
            put(k, get(k)[token, slot].unsqueeze(1))
        for k in row_keys:
            put(k, get(k)[token])
        # no route to this rank's experts: the experts may return zeros outside autograd, and this rank would skip
        # the backward all-reduces of its inputs that the other ranks run (a hang); keep the inputs in the graph
        keep = [get(k) for k in (*weight_keys, *row_keys)] if token.numel() == 0 else []
        module._ep_routes.append((token, index.shape[0], keep))
        return tuple(args), kwargs

    return hook


def _leave(group, tag: str, name: str):
    """Each local route's weighted output added to its token's row (tokens with no local route: zero), then the
    all-reduce over tp sums the ranks' rows."""

    def hook(module, args, kwargs, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"expert-parallel experts {name!r} must return one tensor, got {type(output).__name__}")
        token, tokens, keep = module._ep_routes.pop()
        out = output.new_zeros((tokens, *output.shape[1:])).index_add(0, token, output)
        for t in keep:  # empty tensors: adds 0, carries their (zero) gradients to the region's entry
            if t.requires_grad:
                out = out + t.sum().to(out.dtype)
        return reduce_from_region(out, group, tag=tag)

    return hook


@torch.no_grad()
def keep_placed(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group):
    """Keep this rank's ``E / n`` experts of ``module`` (a transformers experts module: dim 0 of every per-expert
    parameter; an :class:`~lightning_scale.tensor_parallel.expert_lists.ExpertList`: its own experts, by ownership)
    over the ``n`` ranks of ``group``; returns ``(n, local expert count)``."""
    import types

    rank = tp_rank(group)
    n = next(iter(specs.values())).tp if specs else tp_size(group)
    if expert_lists.is_expert_list(module):
        module._tp_expert_specs = {}
        return n, expert_lists.keep_local(name, module, n, rank)
    total = module.num_experts
    for pname, spec in specs.items():
        split_style.keep_local(module, pname, spec, rank)
    module.num_experts = total // n
    module._tp_expert_specs = dict(specs)
    module._apply = types.MethodType(split_style._apply, module)
    return n, total // n


@torch.no_grad()
def place_experts(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group) -> List[object]:
    """Keep this rank's experts of ``module`` (in place: same module, same parameter names, dim 0 = this rank's
    experts; meta stays meta), set its ``num_experts`` to the local count and install the region hooks. Returns
    the hook handles."""
    tp, local = keep_placed(name, module, specs, group)
    rank = tp_rank(group)
    module._ep_routes = []  # (tokens of the local routes, token count, kept inputs) from each call's entry to exit
    module._ep_load = None  # routes per tp rank since the last route_load(reset=True), on the routes' device
    module._tp_expert_parallel = tp  # the memory plan: a rank runs k / tp routes per token at full width
    tag = f"tp/{name}"
    return [module.register_forward_pre_hook(_enter(group, tag, name, rank * local, local), with_kwargs=True),
            module.register_forward_hook(_leave(group, tag, name), with_kwargs=True)]


def route_load(model: nn.Module, reset: bool = True) -> Optional[List[int]]:
    """Routes per tp rank counted by ``model``'s placed experts modules since the last reset (summed over them);
    None when nothing is placed. Every rank of a tp group routes the same tokens alike, so each holds the whole
    count: the busiest rank's share x tp is how much longer than an even split its experts run (the step's pace)."""
    mods = [m for m in model.modules() if getattr(m, "_tp_expert_parallel", 1) > 1 and hasattr(m, "_ep_load")]
    if not mods:
        return None
    total = [0] * mods[0]._tp_expert_parallel
    for m in mods:
        if m._ep_load is not None:
            total = [a + int(b) for a, b in zip(total, m._ep_load.tolist())]
        if reset:
            m._ep_load = None
    return total
