"""Expert parallelism over data-parallel ranks (``Zero3DStrategy(ep=N)``): experts placed whole, tokens exchanged.

DeepSpeed-MoE's and Megatron's expert parallelism. ``ep`` ranks read *different* batches (they are data-parallel
ranks) and each holds ``E / ep`` whole experts of every transformers experts module (``MixtralExperts``,
``Qwen2MoeExperts``, ...: the same placement as style ``expert_parallel``, every per-expert parameter cut along dim 0,
the expert axis). The router runs on every rank over its own tokens; each route (a token's hidden state, once per
expert it picked) travels to the rank holding that expert in one all-to-all, the experts there run every route they
received (from every rank, top-1 with weight 1), the outputs travel back in a second all-to-all, and the sender
multiplies each by its routing weight and adds it to its token's row (experts that take the weight on their input,
Llama 4's, :mod:`~lightning_scale.tensor_parallel.routed_experts`: the sender scales each route's row before it
leaves and adds the outputs as they come back): the module's result is what one process gives
for the same tokens (top-2: exact; more routes per token: up to the order of the sum). Backward runs the two
exchanges the other way; the experts' gradients collect every rank's routes to them.

Every other parameter (attention, norms, router, embeddings, a shared expert) stays whole on the ``ep`` ranks and sees
only its rank's tokens: its gradient is a partial sum over the group (``mark_partial_grad``), added up over ``ep``
before the dp reduction as sequence parallelism's LayerNorm gradients are, bucket by bucket inside the backward
(:mod:`lightning_scale.zero.reducer`, on the tp group's twin),
and the engines divide every gradient by ``ep`` as well as ``dp`` (each rank's loss is its own batch's mean). The grid
carries ``ep`` on its tp axis (``Topology(tp=ep, ep=ep)``): the engines shard every parameter over dp only, so an
expert is replicated over the dp ranks holding the same experts (DeepSpeed's expert-data-parallel group) and whole
on its ``ep`` rank; universal checkpoints record each expert parameter's ``ShardSpec`` (dim 0 over ``ep``) and
resume at any other layout. With pipeline parallelism each stage's experts exchange routes with the other ep ranks of
that stage (every rank runs the same schedule, so they meet at the same micro-batch); with Ulysses sp, with the other
ep ranks of the same sp index (their chunks of the sequences). Not with tp (it would need a grid axis of its own).

Compared with ZeRO-3 over the same ranks (experts sharded, gathered whole before every use): no expert weight
moves, only routes (``2 x T x k x H`` elements per layer and step, each way); the cost is imbalance (the rank whose
experts get most routes sets the pace, :mod:`lightning_scale.strategies.expert_load` reports it).
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn

from lightning_scale.comm import collectives as C
from lightning_scale.tensor_parallel import experts as split_style
from lightning_scale.tensor_parallel.expert_parallel import CallArgs, _routing, keep_placed
from lightning_scale.tensor_parallel.sharding import ShardSpec


class _Exchange(torch.autograd.Function):
    """Rows to ranks (``send`` rows per rank), rows from ranks (``recv`` per rank); backward: the way back."""

    @staticmethod
    def forward(ctx, x, recv, send, group, tag):
        ctx.recv, ctx.send, ctx.group, ctx.tag = recv, send, group, tag
        out = x.new_empty((sum(recv), *x.shape[1:]))
        C.all_to_all_v(out, x.contiguous(), recv, send, group, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        C.all_to_all_v(back, grad.contiguous(), ctx.send, ctx.recv, ctx.group, tag=ctx.tag)
        return back, None, None, None, None


@C.eager_under_compile  # collectives and data-dependent sizes: a deliberate graph break
def exchange(x: torch.Tensor, recv: List[int], send: List[int], group, tag: str) -> torch.Tensor:
    """``x``'s rows, ``send[j]`` of them for rank j in rank order, exchanged; ``recv[i]`` rows from rank i."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Exchange.apply(x, recv, send, group, tag)
    out = x.new_empty((sum(recv), *x.shape[1:]))
    C.all_to_all_v(out, x.contiguous(), recv, send, group, tag=tag)
    return out


@C.eager_under_compile
@torch.no_grad()
def _counts(send: torch.Tensor, group, tag: str) -> List[int]:
    recv = torch.empty_like(send)
    C.all_to_all(recv, send, group, tag=tag)
    return recv.tolist()


def _dispatch(group, tag: str, name: str, ep: int, local: int):
    """Forward pre-hook: this rank's routes sorted by the rank of their expert and sent there; the experts see the
    routes they received, one per row (``(R, H)`` rows, ``(R, 1)`` local ids, weight 1)."""

    def hook(module, args, kwargs):
        call = CallArgs(args, kwargs)
        get, put = call.get, call.put
        id_key, weight_keys, row_keys = _routing(call.args, kwargs, name)
        if len(weight_keys) != 1 or len(row_keys) != 1:
            raise ValueError(f"ep experts {name!r}: expected one hidden-states and one routing-weights argument, got "
                             f"{len(row_keys)} and {len(weight_keys)}")
        index, weights, rows = get(id_key), get(weight_keys[0]), get(row_keys[0])
        k = index.shape[1]
        dest = torch.div(index, local, rounding_mode="floor").flatten()
        order = torch.argsort(dest, stable=True)  # routes grouped by the rank holding their expert
        token, slot = order // k, order % k
        send_t = torch.bincount(dest, minlength=ep)
        _count(module, send_t)
        send = send_t.tolist()
        recv = _counts(send_t, group, tag)
        ids = exchange(index.flatten()[order] - dest[order] * local, recv, send, group, tag)
        routed, weight = rows[token], weights[token, slot]
        if getattr(module, "_scales_input", False):  # Llama 4 (routed_experts.py): expert(x * w), scaled here
            routed, weight = routed * weight.unsqueeze(-1).to(routed.dtype), None
        received = exchange(routed, recv, send, group, tag)
        put(row_keys[0], received)
        put(id_key, ids.unsqueeze(1))
        put(weight_keys[0], torch.ones((ids.shape[0], 1), dtype=weights.dtype, device=weights.device))
        module._ep_routes.append((token, weight, recv, send, rows.shape[0], rows.dtype, received))
        return tuple(call.args), kwargs

    return hook


def _combine(group, tag: str, name: str):
    """Forward hook: every received route's output back to its sender, times its routing weight, added to its token's
    row (a token's routes meet here, as in one process)."""

    def hook(module, args, kwargs, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"ep experts {name!r} must return one tensor, got {type(output).__name__}")
        token, weight, recv, send, tokens, dtype, received = module._ep_routes.pop()
        if torch.is_grad_enabled() and received.requires_grad and not output.requires_grad:
            # no route reached this rank's experts (or they returned zeros outside autograd): keep the exchange in the
            # graph, or this rank would skip the backward all-to-alls the other ranks run (a hang)
            output = output + received.sum().to(output.dtype)
        back = exchange(output, send, recv, group, tag)
        if weight is None:  # the routing weight scaled the input already
            weighted = back
        elif back.dtype != weight.dtype:
            weighted = back * weight.unsqueeze(-1).to(back.dtype)
        else:
            weighted = back * weight.unsqueeze(-1)
        return weighted.new_zeros((tokens, *back.shape[1:])).index_add(0, token, weighted).to(dtype)

    return hook


@torch.compiler.disable
@torch.no_grad()
def _count(module: nn.Module, send: torch.Tensor) -> None:
    """This rank's routes per destination rank (:func:`lightning_scale.tensor_parallel.expert_parallel.route_load`;
    the Trainer sums them over the group)."""
    module._ep_load = send.clone() if module._ep_load is None else module._ep_load + send


@torch.no_grad()
def place_experts_exchanged(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group) -> List[object]:
    """Keep this rank's ``E / ep`` experts of ``module`` whole (in place; meta stays meta), set its ``num_experts`` to
    the local count, install the exchange hooks. Returns the hook handles."""
    ep, local = keep_placed(name, module, specs, group)
    module._ep_routes = []
    module._ep_load = None
    module._tp_expert_parallel = ep  # the memory plan: a rank runs k / ep routes per token at full width
    module._ep_exchange = True
    tag = f"ep/{name}"
    return [module.register_forward_pre_hook(_dispatch(group, tag, name, ep, local), with_kwargs=True),
            module.register_forward_hook(_combine(group, tag, name), with_kwargs=True)]


def expert_data_parallel_plan(model: nn.Module, ep: int) -> Dict[str, str]:
    """``{name: 'expert_data_parallel'}`` for every transformers experts module of ``model`` (Llama 4's dense ones made
    routed in place first); a ConfigError naming ``ep`` when there is none or one cannot be placed."""
    from lightning_scale.config import ConfigError
    from lightning_scale.tensor_parallel.expert_parallel import unsupported

    from lightning_scale.tensor_parallel.expert_lists import (
        is_expert_list,
        is_routable,
        loops_over_a_plain_list,
        route_blocks,
    )
    from lightning_scale.tensor_parallel.routed_experts import route_experts

    route_experts(model)  # Llama 4's dense experts routed first (same math): then they place and exchange
    route_blocks(model)  # litgpt's MoE blocks call their experts list on routes (expert_lists.py)
    plan, refused = {}, []
    for name, module in model.named_modules():
        if is_expert_list(module):  # litgpt's (routed above) or a user's block's lightning_scale.nn.ExpertList
            if len(module) % ep:
                refused.append(f"{name}: {len(module)} experts do not split over ep={ep} ranks")
            else:
                plan[name] = "expert_data_parallel"
        elif loops_over_a_plain_list(module) and not is_routable(module):
            refused.append(f"{name}: {unsupported(module)}")
        elif split_style.is_fused_experts(module):  # DBRX: refused by name, not "no experts module"
            refused.append(f"{name}: {unsupported(module)}")
        elif split_style.is_experts(module):
            why = unsupported(module)
            if why is not None:
                refused.append(f"{name}: {why}")
            elif module.num_experts % ep:
                refused.append(f"{name}: {module.num_experts} experts do not split over ep={ep} ranks")
            else:
                plan[name] = "expert_data_parallel"
    if refused:
        raise ConfigError(f"ep={ep}: {'; '.join(refused[:3])}", settings=("ep",))
    if not plan:
        stacked = next(((n, m) for n, m in model.named_modules() if "expert" in type(m).__name__.lower()
                        and any(p.dim() == 3 for p in m.parameters(recurse=False))), None)
        if stacked is not None:  # a mixture of experts of a layout not known here (JetMoE's JetMoeParallelExperts)
            raise ConfigError(f"ep={ep}: {stacked[0]} ({type(stacked[1]).__name__}) holds stacked 3-D expert weights "
                              "of a layout expert parallelism does not place (it places transformers experts modules, "
                              "litgpt MoE blocks and lightning_scale.nn.ExpertList); train it with ZeRO-3, pp or sp",
                              settings=("ep",))
        raise ConfigError(f"ep={ep}: {type(model).__name__} has no transformers experts module (3-D expert weights), "
                          "litgpt MoE block nor lightning_scale.nn.ExpertList to place: expert parallelism needs a "
                          "mixture-of-experts model",
                          settings=("ep",))
    return plan
