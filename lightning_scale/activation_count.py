"""What a unit keeps, counted from its layers' sizes where it is not profiled on fake tensors (the fallback of
:mod:`lightning_scale.activation_plan`): its Linear layers' inputs and outputs, and a mixture of experts' stacked expert
weights (every route through them, as one rank runs them: split over tp, placed, or exchanged over ep), with the
stand-in that lets the rest of such a unit run on fake tensors (:func:`_experts_stubbed`).

Per token, float32 bytes, the keys of :func:`lightning_scale.activation_profile.profile_unit`.
"""

from __future__ import annotations

import contextlib
from typing import Dict


def experts_per_token(unit) -> int:
    """How many experts each token visits in a mixture-of-experts ``unit`` (its router's ``top_k`` /
    ``num_experts_per_tok``; 1 where none is found)."""
    for m in unit.modules():
        for attr in ("top_k", "num_experts_per_tok"):
            k = getattr(m, attr, None)
            if isinstance(k, int) and k > 0:
                return k
        for attr in ("num_experts_per_tok", "n_expert_per_token"):  # transformers' / litgpt's config
            k = getattr(getattr(m, "config", None), attr, None)
            if isinstance(k, int) and k > 0:
                return k
    return 1


def _fused_experts(unit) -> list:
    """DBRX's experts modules in ``unit``: every expert's weights as 2-D (E * I, H) rows."""
    from lightning_scale.tensor_parallel.experts import is_fused_experts

    return [m for m in unit.modules() if is_fused_experts(m)]


def _expert_weights(unit) -> list:
    """The unit's 3-D parameters outside Linear and convolution layers: stacked expert weights ``(experts, out, in)``;
    and DBRX's 2-D expert rows (``w1`` / ``v1`` / ``w2``, each (E * I, H)). (A Mamba mixer's depthwise ``conv1d``
    weight is 3-D too: taken for experts, the hybrid families' units were counted as a mixture of experts, 3.4x
    under the measured step for Nemotron-H.)"""
    import torch.nn as nn

    in_linear = {id(p) for m in unit.modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))
                 for p in m.parameters(recurse=False)}
    fused = [getattr(m.mlp, n) for m in _fused_experts(unit) for n in ("w1", "v1", "w2")]
    return [p for p in unit.parameters() if p.dim() == 3 and id(p) not in in_linear] + fused


def _expert_matmuls(unit, tp: int) -> list:
    """(in, out) features per token of each stacked expert weight of ``unit``, as one rank runs it: a transformers
    experts module of an unsplit unit at ``tp`` > 1 is split by the ``experts`` style (every expert's intermediate
    width over tp, :mod:`lightning_scale.tensor_parallel.experts`); a split one is counted at its local shapes, a
    placed one (style ``expert_parallel``) at full width for 1 / tp of the routes."""
    from lightning_scale.tensor_parallel.experts import expert_specs, is_experts
    from lightning_scale.tensor_parallel.sharding import tp_spec

    shapes = {id(p): tuple(p.shape) for p in _expert_weights(unit)}
    transposed, placed = set(), {}
    for m in _fused_experts(unit):  # DBRX: w1 / v1 as (E, I, H) = (experts, out, in); w2 read transposed (E, in, out)
        cut = tp if tp > 1 and tp_spec(m.mlp.w1) is None and m.ffn_hidden_size % tp == 0 else 1  # split by 'experts'
        for n in ("w1", "v1", "w2"):
            p = getattr(m.mlp, n)
            shapes[id(p)] = (m.num_experts, p.shape[0] // m.num_experts // cut, p.shape[1])
        transposed.add(id(m.mlp.w2))
    for m in unit.modules():
        if not is_experts(m):
            continue
        if m.is_transposed:
            transposed.update(id(p) for p in m.parameters(recurse=False))
        # placed whole by style expert_parallel: full widths, k / tp of each token's routes on this rank (in
        # expectation; split experts run all k routes at I / tp, reading the whole hidden state on each)
        # (ep > 1, expert_alltoall: the ranks hold different tokens and each runs the routes of every rank to its
        # experts, k per local token in expectation: no division)
        share = 1 if getattr(m, "_ep_exchange", False) else getattr(m, "_tp_expert_parallel", 1)
        placed.update({id(p): share for p in m.parameters(recurse=False)})
        if tp > 1 and not any(tp_spec(p) is not None for p in m.parameters(recurse=False)):
            try:
                specs = expert_specs("", m, tp)
            except ValueError:  # left whole by the built-in plan
                continue
            for pname, spec in specs.items():
                shapes[id(getattr(m, pname))] = spec.local_shape(getattr(m, pname).shape)
    # (experts, out, in); transposed layouts store (experts, in, out)
    pairs = {i: (s[1], s[2]) if i in transposed else (s[2], s[1]) for i, s in shapes.items()}
    out = [(a / placed.get(i, 1), b / placed.get(i, 1)) for i, (a, b) in pairs.items()]
    for m in unit.modules():  # a placed module's experts get the hidden rows of their routes gathered (one per
        # route, kept with the route indices for the backward: ~5% of a tiny Mixtral's step-1 peak), an input of
        # width H for k / tp routes per token
        if is_experts(m) and getattr(m, "_tp_expert_parallel", 1) > 1:
            weight = next(p for p in m.parameters(recurse=False) if p.dim() == 3)
            hidden = pairs[id(weight)][0]
            if getattr(m, "_ep_exchange", False):  # ep: the received rows (the experts' input) and the outputs sent
                out.append((hidden, hidden))  # back (kept by the routing-weight product), k per local token
            else:
                out.append((hidden / m._tp_expert_parallel, 0.0))
    return out


def _expert_bytes(unit, tp: int) -> Dict[str, float]:
    """Per-token bytes of a unit's stacked expert matmuls alone: ``k`` routes per token through every expert weight,
    its input and output, and what the elementwise ops between and after them keep (the gated activation, the
    routing weight) counted as half of every expert output: with it the step-1 plan of a tiny Mixtral / Qwen2-MoE
    (1024 tokens, ZeRO-2, with and without full AC) is within 7% of the measured peak (2026-12-05)."""
    experts = _expert_matmuls(unit, tp)
    if not experts:
        return {}
    k = experts_per_token(unit)
    outs, ins = k * sum(o for _, o in experts), k * sum(i for i, _ in experts)
    widest = max(o for _, o in experts)
    return {"saved": 4.0 * (ins + outs + outs / 2), "selective": 4.0 * outs, "backward": 4.0 * 2 * widest}


@contextlib.contextmanager
def _experts_stubbed(unit):
    """While inside, every transformers experts module of ``unit`` is replaced in its parent by a stand-in that returns
    zeros of its hidden states' shape (no saved tensor, no hook, no collective): the rest of the unit (attention with
    its mask, router, shared expert) runs on fake tensors."""
    import torch
    import torch.nn as nn

    from lightning_scale.tensor_parallel.experts import is_experts, is_fused_experts

    class Stub(nn.Module):
        def forward(self, hidden_states, *args, **kwargs):
            return torch.zeros_like(hidden_states)

    swapped = []
    for parent in list(unit.modules()):
        for name, child in list(parent.named_children()):
            if is_experts(child) or is_fused_experts(child):
                swapped.append((parent, name, child))
                parent._modules[name] = Stub()
    try:
        yield bool(swapped)
    finally:
        for parent, name, child in swapped:
            parent._modules[name] = child


def _counted_profile(unit, hidden: int, tp: int) -> Dict[str, float]:
    """The fallback when a unit's forward cannot run alone: Linear layers' input + output sizes (float32). A mixture
    of experts (its routing has data-dependent shapes: no fake-tensor profile) counts its stacked expert weights
    ``(experts, out, in)`` as linears each token passes ``k`` times (:func:`experts_per_token`); without them a
    Mixtral layer's activations were under-counted 2.8x."""
    import torch.nn as nn

    from lightning_scale.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from lightning_scale.tensor_parallel.expert_lists import is_routable, tp_owned
    from lightning_scale.tensor_parallel.experts import is_moe_block
    from lightning_scale.tensor_parallel.sharding import tp_spec

    lin = [m for m in unit.modules() if isinstance(m, nn.Linear)]
    # a MoE block of nn.Linear experts (litgpt's LLaMAMoE, a user's ExpertList): each token visits k of its E
    # experts, so each expert's layers see k / E of the tokens (counting every expert for every token was 1.3x over
    # the measured step)
    share: Dict[int, float] = {}
    routed = 0.0  # per token: rows of placed experts' routes gathered (tp) or exchanged (ep) beside the linears
    for m in unit.modules():
        if is_moe_block(m) or is_routable(m):  # litgpt's, or a user's block calling a lightning_scale.nn.ExpertList
            k = min(experts_per_token(m), len(m.experts))
            # placed by ownership (expert_lists.py): ep, the local experts run every rank's routes to them (k / E of
            # each token of every rank: k / local of this rank's); tp, this rank's routes only (k / E)
            n = getattr(m.experts, "_tp_expert_parallel", 1)
            exchanged = getattr(m.experts, "_ep_exchange", False)
            local = len(m.experts) * (1 if exchanged else n)
            share.update({id(sub): k / local for e in m.experts for sub in e.modules()})
            if n > 1:  # the routes' rows: received and sent back (ep), or gathered for k / tp routes (tp)
                routed += 2 * k * hidden if exchanged else k * hidden / n
    # split already by the experts style (nn.Linear at local widths) or not split yet (1 / tp of it per rank)
    # (an expert placed by ownership is whole on its rank: its share says how many routes it runs)
    per_rank = {id(m): share.get(id(m), 1.0) / (1 if tp_spec(m.weight) is not None or tp_owned(m.weight) else tp)
                for m in lin}
    outs = sum(m.out_features * per_rank[id(m)] for m in lin)
    ins = sum(m.in_features * per_rank[id(m)] for m in lin) + routed
    widest = max((m.out_features / (1 if tp_spec(m.weight) is not None else tp) for m in lin), default=hidden / tp)
    # a unit split already (a live tp model): its parallel layers at their local widths (a column-parallel layer
    # makes out / tp, a row-parallel one reads in / tp); they are not nn.Linear, and were missed (a Hugging Face
    # Llama's plan at tp=2 was 2.98x under the measured step)
    for m in unit.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            in_f, out_f = m.local_features
            outs, ins, widest = outs + out_f, ins + in_f, max(widest, out_f)
    extra = _expert_bytes(unit, tp)
    return {"saved": 4.0 * (ins + outs + 2 * hidden) + extra.get("saved", 0.0), "input": 4.0 * hidden,
            "selective": 4.0 * (hidden + outs) + extra.get("selective", 0.0),
            "backward": max(4.0 * 2 * max(widest, hidden), extra.get("backward", 0.0))}
