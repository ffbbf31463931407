"""Hugging Face mixture-of-experts layers that run every expert on every token, made routed (same math).

transformers' Llama 4 (``Llama4TextMoe``) computes its experts densely: every token's hidden state, scaled by its
router score (``sigmoid`` of the chosen experts' logits, 0 for the others), goes through *every* expert
(``Llama4TextExperts``: one ``bmm`` over ``(E, T, H)``), and the ``E`` outputs are summed; the experts a token did
not pick see a zero row and return zeros. That is ``E / k`` times the expert work of routing (16x for Scout's 16
experts, top-1), an ``(E x T, H)`` input and ``(E x T, 2I)`` intermediate kept for the backward, and no route to
dispatch, so transformers gives it no expert-parallel plan ("nothing to dispatch").

:func:`route_experts` turns each such layer into the routed form, in place (the same modules and parameters, the
same state-dict keys; only the two classes swapped for subclasses with another ``forward``):

* the MoE layer asks its router as before (``(scores, logits)``), takes the router's own choice
  (``topk(logits, k)``, as ``Llama4Router`` does) and its scores there, and calls the experts with
  ``(hidden states (T, H), expert ids (T, k), scores (T, k))``, transformers' call for routed experts;
* the experts run only the routes: expert ``e`` gets the rows of the tokens that picked it, each *scaled by its
  score before the expert* (Llama 4's order: ``expert(x * s)``, not ``s * expert(x)``; a zero row gives a zero output
  and zero gradients through SiLU, so skipping the unpicked rows changes nothing), and each route's output is added
  to its token's row; the module records the layout ``use_experts_implementation`` records for transformers' own
  experts (``is_transposed``: ``gate_up_proj`` ``(E, H, 2I)`` as ``[gate | up]``, ``down_proj`` ``(E, I, H)``), and
  ``_scales_input = True``.

So every expert parallelism here applies to Llama 4 as to Mixtral: style ``experts`` (every expert's width split
over tp: the score scales the input, the same on every rank, and the split's sum is linear), ``expert_parallel``
(whole experts per tp rank) and ``ep`` (routes exchanged; the sender scales each route's row before it travels and
adds the returned outputs unweighted, :mod:`lightning_scale.tensor_parallel.expert_alltoall`). Top-1 (Llama 4's
setting): every token's output is one expert's, as in the dense sum (the order of a matmul's rows aside, last-bit
differences); top-k > 1: up to the order of the sum.

:func:`~lightning_scale.parallelize.parallelize` (every strategy and Fabric), the autotuner and
:func:`~lightning_scale.tensor_parallel.apply_tensor_parallel` call it; the startup table's ``experts`` row says so.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn

# class name of the dense MoE layer -> class name of its experts module
_DENSE_MOE = {"Llama4TextMoe": "Llama4TextExperts"}
_ROUTED: Dict[type, type] = {}
# where transformers defines them (a routed class is rebuilt from it when a pickle is read in a fresh process)
_MODULES = {"Llama4TextMoe": "transformers.models.llama4.modeling_llama4",
            "Llama4TextExperts": "transformers.models.llama4.modeling_llama4"}


def _moe_forward(self, hidden_states: torch.Tensor):
    """Llama4TextMoe.forward, routed: (T, H) -> (output (T, H), router logits (T, E)), as the dense one returns."""
    x = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(x)  # scores: sigmoid of the chosen experts' logits, 0 elsewhere
    index = torch.topk(logits, self.top_k, dim=1).indices  # the router's own choice (Llama4Router.forward)
    out = self.shared_expert(x)
    return out + self.experts(x, index, scores.gather(1, index)), logits


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """Llama4TextExperts on routes: (T, H) rows, (T, k) expert ids, (T, k) scores -> (T, H), each route's
    ``down(act(gate) * up)`` of its score-scaled row added to its token's row. The routes are sorted by expert once
    (one host read of the per-expert counts), each expert runs one contiguous block of rows."""
    k = top_k_index.shape[1]
    ids = top_k_index.flatten()
    order = torch.argsort(ids, stable=True)
    token = torch.div(order, k, rounding_mode="floor")
    x = hidden_states[token] * top_k_weights.flatten()[order].unsqueeze(-1).to(hidden_states.dtype)
    counts = torch.bincount(ids, minlength=self.num_experts).tolist()  # num_experts: this rank's once placed
    # unbind: one backward that stacks the experts' gradients (indexing [e] would build a whole-size gradient per
    # expert, 80% of the layer's time at 16 experts)
    gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = (x[start:start + n] @ gate_up[e]).chunk(2, dim=-1)
            outs.append((up * self.act_fn(gate)) @ down[e])
            start += n
    out = hidden_states.new_zeros(hidden_states.shape)
    return out.index_add(0, token, torch.cat(outs)) if outs else out


def _routed_class(cls: type, forward) -> type:
    """A subclass of ``cls`` with ``forward``, importable by name from this module (the model still pickles)."""
    if cls not in _ROUTED:
        name = f"Routed{cls.__name__}"
        new = type(name, (cls,), {"forward": forward, "__module__": __name__, "__qualname__": name})
        globals()[name] = new
        _ROUTED[cls] = new
    return _ROUTED[cls]


def __getattr__(name: str):
    """``RoutedLlama4TextMoe`` / ``RoutedLlama4TextExperts`` asked for by name (unpickling a routed model in a process
    that has not routed one yet): built from transformers' class as :func:`route_experts` builds it."""
    base = name[len("Routed"):] if name.startswith("Routed") else None
    if base not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    cls = getattr(importlib.import_module(_MODULES[base]), base)
    return _routed_class(cls, _moe_forward if base in _DENSE_MOE else _experts_forward)


def _is_dense_moe(module: nn.Module) -> bool:
    experts = _DENSE_MOE.get(type(module).__name__)
    return (experts is not None and type(getattr(module, "experts", None)).__name__ == experts
            and isinstance(getattr(module, "router", None), nn.Module) and hasattr(module, "shared_expert"))


def route_experts(model: nn.Module) -> List[str]:
    """Turn every dense Hugging Face MoE layer of ``model`` (Llama 4's) into its routed form, in place; the names of
    the layers turned (empty when there is none; a second call finds none)."""
    done = []
    for name, module in model.named_modules():
        if not _is_dense_moe(module):
            continue
        experts = module.experts
        experts.__class__ = _routed_class(type(experts), _experts_forward)
        experts.is_transposed, experts.is_concatenated, experts.has_gate, experts.has_bias = True, True, True, False
        experts.has_post_expert_norm = False
        experts._scales_input = True  # the routing weight scales the expert's input, not its output
        module.__class__ = _routed_class(type(module), _moe_forward)
        done.append(name)
    return done
