"""Expert parallelism over the tp group: each tp rank holds ``E / tp`` whole experts of a mixture-of-experts layer.

Style ``expert_parallel`` (``Zero3DStrategy(tp=N, expert_parallel=True)`` gives it to every experts module of a
Hugging Face model's built-in plan) is the other way to share a transformers experts module (``MixtralExperts``,
``Qwen2MoeExperts``, ... : 3-D ``gate_up_proj`` / ``down_proj``, optional per-expert biases) over tp than style
``experts`` (:mod:`lightning_scale.tensor_parallel.experts`, every expert's intermediate width cut over tp): rank
``r`` keeps experts ``[r * E / tp, (r + 1) * E / tp)`` whole (every per-expert parameter cut along dim 0, the expert
axis). The ranks of a tp group hold the same tokens, so no token moves: each rank runs the routes to its own
experts (the router stays whole and routes alike on every rank), the routes to other ranks' experts are masked with
the local sentinel id ``E / tp`` (which transformers' experts forwards skip: its own expert-parallel layer uses the
same contract) and weight 0, and one all-reduce of the module's output sums the ranks' partial outputs, as style
``experts`` does. Backward: the gradients of the hidden states and of the routing weights are partial on each rank
(only its routes) and are all-reduced (``copy_to_region``).

Why a user picks it over ``experts``: each expert's matmuls keep their full width (``I`` instead of ``I / tp``:
larger, more efficient GEMMs, the reason Megatron prefers expert parallelism for many small experts), a rank loops
over ``E / tp`` experts instead of ``E``, and experts ``experts`` cannot split are placed (per-expert biases: each
bias lives on one rank and is added once; a norm after each expert; an intermediate width tp does not divide).
The cost: a rank's work follows the router (imbalanced routing makes the busiest rank set the pace), and ``E`` must
be a multiple of tp. With top-2 routing the sum is exact (each token's two expert outputs meet once, in the same
order as one process); with more routes per token, up to the order of the sum.

Not placed (ConfigError at plan time): a MoE *block* of ``nn.Linear`` experts (litgpt's ``LLaMAMoE``, a user's
``experts`` ModuleList: its parameters are named per expert and there is no sentinel to skip a route; split it with
``experts``), and an experts module without an integer ``num_experts`` (the count its forward masks by).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from lightning_scale.tensor_parallel import experts as split_style
from lightning_scale.tensor_parallel.mappings import copy_to_region, tp_rank
from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec, mark_sharded, shard_tensor


def unsupported(module: nn.Module) -> Optional[str]:
    """Why ``expert_parallel`` cannot place ``module``'s experts (None when it can)."""
    kind = type(module).__name__
    if split_style.is_moe_block(module):
        return (f"{kind} is a mixture-of-experts block of nn.Linear experts (an experts list, parameters named per "
                f"expert): expert_parallel places transformers' experts modules (3-D expert weights); split this "
                f"block's experts over tp with style 'experts' (tensor.expert_parallel=False)")
    if not split_style.is_experts(module):
        return (f"{kind} is not a transformers experts module (3-D gate_up_proj / down_proj weights with the layout "
                f"use_experts_implementation records)")
    if not isinstance(getattr(module, "num_experts", None), int) or isinstance(module.num_experts, bool):
        return f"{kind} has no integer num_experts (the expert count its forward masks routes by)"
    if _eager(module) and not _eager_skips_sentinel(module):
        return (f"{kind}'s own (eager) forward cannot skip the routes to other ranks' experts (its one-hot spans "
                f"num_experts only); set the model config's experts_implementation='batched_mm' (or 'grouped_mm'), "
                f"which transformers' expert parallelism uses, or split the experts with style 'experts'")
    return None


def _eager(module: nn.Module) -> bool:
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return impl in (None, "eager")


def _eager_skips_sentinel(module: nn.Module) -> bool:
    """Whether the experts class's own forward skips the sentinel id ``num_experts`` (a one-hot over
    ``num_experts + 1`` classes, as transformers' MoE template writes it; GPT-OSS's spans ``num_experts``)."""
    import inspect

    forward = type(module).forward
    forward = getattr(forward, "__wrapped__", forward)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return True  # no source to read: trust the contract (a wrong guess fails at the first step, loudly)
    return "one_hot" not in source or "num_experts + 1" in source


def placed_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    """The shard spec (dim 0, the expert axis) of every parameter of ``module`` over ``tp`` ranks; ValueError naming
    the expert count tp does not divide, or why the module cannot be placed."""
    why = unsupported(module)
    if why is not None:
        raise ValueError(f"style 'expert_parallel' on {name!r}: {why}")
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


def _routing(args, kwargs, name: str):
    """(position or key of the expert ids, of the routing weights) among a call's arguments: the one integer tensor,
    and the floating tensor of the same shape."""
    items = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    ids = [k for k, t in items if isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()]
    if len(ids) != 1:
        raise ValueError(f"expert-parallel experts {name!r}: expected one integer tensor of expert ids among its "
                         f"arguments, found {len(ids)}")
    index = dict(items)[ids[0]]
    weights = [k for k, t in items if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == index.shape]
    return ids[0], weights


def local_routes(index: torch.Tensor, first: int, local: int):
    """(this rank's expert ids, the routes to other ranks): the global ids of experts ``[first, first + local)`` as
    local ids, every other route as the sentinel ``local`` (which the experts forward skips)."""
    off = (index < first) | (index >= first + local)
    return torch.where(off, torch.full_like(index, local), index - first), off


def _enter(group, tag: str, name: str, first: int, local: int):
    def hook(module, args, kwargs):
        args = list(args)

        def get(k):
            return args[k] if isinstance(k, int) else kwargs[k]

        def put(k, v):
            if isinstance(k, int):
                args[k] = v
            else:
                kwargs[k] = v

        # every floating input that carries a gradient (hidden states, routing weights): partial here (this rank's
        # routes only), summed over tp; entered before the masking below, so the sum sees every rank's routes
        for k in list(range(len(args))) + list(kwargs):
            t = get(k)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                put(k, copy_to_region(t, group, tag=tag))
        id_key, weight_keys = _routing(args, kwargs, name)
        index, off = local_routes(get(id_key), first, local)
        put(id_key, index)
        for k in weight_keys:
            put(k, get(k).masked_fill(off, 0.0))
        return tuple(args), kwargs

    return hook


@torch.no_grad()
def place_experts(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group) -> List[object]:
    """Keep this rank's experts of ``module`` (in place: same module, same parameter names, dim 0 = this rank's
    experts; meta stays meta), set its ``num_experts`` to the local count and install the region hooks. Returns
    the hook handles."""
    import types

    rank, tp = tp_rank(group), next(iter(specs.values())).tp
    total = module.num_experts
    for pname, spec in specs.items():
        full = getattr(module, pname)
        if full.is_meta:
            local = torch.empty(spec.local_shape(full.shape), device="meta", dtype=full.dtype)
        else:
            local = shard_tensor(full.detach(), spec, rank)
        param = nn.Parameter(local, requires_grad=full.requires_grad)
        mark_sharded(param, spec)
        setattr(module, pname, param)
    local = total // tp
    module.num_experts = local
    module._is_expert_parallel = True  # transformers' batched_mm / grouped_mm forwards mask the sentinel routes then
    module._tp_expert_specs = dict(specs)
    module._tp_expert_parallel = tp  # the memory plan: a rank runs k / tp routes per token at full width
    module._apply = types.MethodType(split_style._apply, module)
    tag = f"tp/{name}"
    return [module.register_forward_pre_hook(_enter(group, tag, name, rank * local, local), with_kwargs=True),
            module.register_forward_hook(split_style._leave(group, tag, name), with_kwargs=True)]
