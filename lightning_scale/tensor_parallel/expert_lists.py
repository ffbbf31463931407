"""Whole experts placed on ranks for a mixture-of-experts block whose experts are a *list* of MLP modules (litgpt).

litgpt's ``LLaMAMoE`` (Mixtral, Qwen3-MoE, DeepSeek-V3 ... in litgpt) holds its router (``gate``), an ``experts``
``nn.ModuleList`` of ``LLaMAMLP`` and an optional ``shared_experts`` MLP; each expert's parameters are named per
expert (``mlp.experts.3.fc_1.weight``). transformers' experts modules keep one 3-D tensor per projection instead,
which expert parallelism places by cutting dim 0 (:mod:`~lightning_scale.tensor_parallel.expert_parallel`,
:mod:`~lightning_scale.tensor_parallel.expert_alltoall`). A list is placed by *ownership*: rank ``r`` of ``n``
keeps experts ``[r E / n, (r + 1) E / n)`` whole, under their own names (the list keeps the global indices as its
keys, so ``experts.2`` stays ``experts.2`` on the rank holding it), and the others are dropped from that rank.
A parameter kept this way is marked ``tp_owned``: it is not replicated over the group (each of its values lives on
one rank), so a global gradient norm counts it on its rank (:func:`~lightning_scale.tensor_parallel.sharding
.tp_replicated`), its gradient is not summed over the ep ranks, a layout-free checkpoint gets it from its one
holder (as a pipeline stage's own parameters), :func:`~lightning_scale.tensor_parallel.state
.consolidate_state_dict` gathers every rank's experts, and loading a whole state dict keeps only this rank's.

:func:`route_blocks` makes each such block call its experts as transformers calls routed experts: the block's
forward is litgpt's (the same router, top-k, routing softmax in float32, grouped router, routed scaling factor,
shared expert) up to the expert loop, which becomes ``experts(x (T, H), expert ids (T, k), weights (T, k))``; the
list (an :class:`ExpertList`) runs each of its experts on the rows routed to it (sorted by expert once) and adds
``weight * expert(row)`` to each token's row, in expert order, as litgpt's loop does (top-2: the same sums). Both
classes are swapped in place (subclasses: the same parameters, the same state-dict keys; the model still pickles).
Then the exchange (``ep``) and the tp regions (``tensor.expert_parallel``) of the 3-D experts apply unchanged.
"""

from __future__ import annotations

import types
from typing import Dict, List, Optional, Set

import torch
import torch.nn as nn

# the blocks routed here: (module, class name) -> the MoE blocks this forward reproduces
_BLOCKS = {("litgpt.model", "LLaMAMoE")}
_ROUTED: Dict[type, type] = {}


def _litgpt_moe_forward(self, x: torch.Tensor) -> torch.Tensor:
    """litgpt's ``LLaMAMoE.forward`` with the expert loop handed to ``self.experts`` (an :class:`ExpertList`)."""
    B, T, C = x.size()
    flat = x.view(-1, C)
    config = self.config
    if not config.n_expert_groups:
        probs, indices = torch.topk(self.gate(flat), config.n_expert_per_token)
        probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=flat.dtype)
    else:
        probs, indices = self.gate(flat)
    if config.routed_scaling_factor != 1.0:
        probs = probs * config.routed_scaling_factor
    y = self.experts(flat, indices, probs).view(B, T, C)
    if config.n_shared_expert:
        y = y + self.shared_experts(x)
    return y


class ExpertList(nn.ModuleList):
    """A list of expert MLPs called on routes: ``(hidden states (T, H), expert ids (T, k), weights (T, k))`` ->
    ``(T, H)``, ids counted among the experts this list holds (all of them until placed). Its keys stay the experts'
    global indices after placement.

    Public as :class:`lightning_scale.nn.ExpertList` for a user's own mixture-of-experts block: hold the experts in
    one and call it on the router's choices instead of looping over them, and ``ep=N`` / ``tensor.expert_parallel``
    place its experts (whole, each on one rank) and exchange or gather the routes; ``top_k`` (the routes per token)
    tells the memory plan how many rows each expert runs (without it, the block's ``top_k`` attribute or 1)::

        self.experts = ExpertList([MyMLP(h, i) for _ in range(8)], top_k=2)
        ...
        weights, ids = torch.topk(self.router(x).softmax(-1), 2)   # x: (tokens, hidden)
        y = self.experts(x, ids, weights)                          # sum_k weights[:, k] * expert_ids[:, k](x)
    """

    def __init__(self, modules=None, top_k: Optional[int] = None) -> None:
        super().__init__(modules)
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise ValueError(f"ExpertList(top_k={top_k!r}): the routes per token must be a positive int")
        self.top_k = top_k

    @property
    def num_experts(self) -> int:
        return len(self._modules)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[1]
        ids = top_k_index.flatten()
        order = torch.argsort(ids, stable=True)  # routes grouped by expert, each token's in slot order
        token = torch.div(order, k, rounding_mode="floor")
        x, w = hidden_states[token], top_k_weights.flatten()[order].unsqueeze(-1)
        counts = torch.bincount(ids, minlength=len(self._modules)).tolist()
        outs, start = [], 0
        for expert, n in zip(self._modules.values(), counts):
            if n:
                outs.append(w[start:start + n] * expert(x[start:start + n]))
                start += n
        out = hidden_states.new_zeros(hidden_states.shape)
        return out.index_add(0, token, torch.cat(outs).to(out.dtype)) if outs else out


def _routed_class(cls: type) -> type:
    if cls not in _ROUTED:
        name = f"Routed{cls.__name__}"
        new = type(name, (cls,), {"forward": _litgpt_moe_forward, "__module__": __name__, "__qualname__": name})
        globals()[name] = new
        _ROUTED[cls] = new
    return _ROUTED[cls]


def __getattr__(name: str):
    """``RoutedLLaMAMoE`` asked for by name (unpickling in a process that has routed none yet)."""
    for mod, cls_name in _BLOCKS:
        if name == f"Routed{cls_name}":
            import importlib

            return _routed_class(getattr(importlib.import_module(mod), cls_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_routable(module: nn.Module) -> bool:
    """A MoE block that calls its experts on routes: litgpt's ``LLaMAMoE`` (routed or not: :func:`route_blocks`
    knows its forward), or a user's block whose ``experts`` is an :class:`ExpertList`."""
    cls = type(module)
    if cls in _ROUTED.values() or isinstance(getattr(module, "experts", None), ExpertList):
        return True
    return (cls.__module__, cls.__name__) in _BLOCKS and isinstance(getattr(module, "experts", None), nn.ModuleList)


def loops_over_a_plain_list(module: nn.Module) -> bool:
    """A block whose ``experts`` is a plain ``nn.ModuleList`` (not an :class:`ExpertList`): its forward loops over
    them in a way not known here."""
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.ModuleList) and not isinstance(experts, ExpertList) and len(experts) > 0


def route_blocks(model: nn.Module) -> List[str]:
    """Swap every routable block of ``model`` (and its experts list) for the routed subclasses, in place; the names of
    the blocks turned (a second call finds none)."""
    done = []
    for name, module in model.named_modules():
        if (is_routable(module) and type(module) not in _ROUTED.values()
                and (type(module).__module__, type(module).__name__) in _BLOCKS):
            module.experts.__class__ = ExpertList
            module.__class__ = _routed_class(type(module))
            done.append(name)
    return done


def is_expert_list(module: nn.Module) -> bool:
    return isinstance(module, ExpertList)


def mark_owned(param: torch.Tensor) -> None:
    """A parameter held whole by one rank of its group and by no other (not replicated, not split)."""
    param.tp_owned = True


def tp_owned(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tp_owned", False))


def _apply(self, fn, recurse=True):
    """``nn.Module._apply``, then the kept experts' parameters marked again (``.to_empty()`` builds new ones)."""
    out = type(self)._apply(self, fn, recurse)
    for p in self.parameters():
        mark_owned(p)
    return out


@torch.no_grad()
def keep_local(name: str, module: ExpertList, n: int, rank: int) -> int:
    """Keep experts ``[rank E / n, (rank + 1) E / n)`` of ``module`` under their global keys, drop the others, mark
    the kept parameters owned; ValueError naming ``name`` when ``n`` does not divide the expert count. Returns the
    local count."""
    total = len(module._modules)
    if total % n:
        raise ValueError(f"{total} experts of {name!r} do not split over {n} ranks")
    local = total // n
    keys = list(module._modules)
    kept = keys[rank * local:(rank + 1) * local]
    for key in keys:
        if key not in kept:
            del module._modules[key]
    for p in module.parameters():
        mark_owned(p)
    module._placed = (total, n, rank)  # (experts in all, ranks, this rank)
    module._apply = types.MethodType(_apply, module)
    return local


def placed_lists(model: nn.Module) -> Dict[str, ExpertList]:
    """name -> every placed expert list of ``model``."""
    return {n: m for n, m in model.named_modules() if is_expert_list(m) and getattr(m, "_placed", None)}


def foreign_keys(model: nn.Module, keys) -> Set[str]:
    """The keys among ``keys`` (a whole model's state-dict keys) that belong to experts another rank holds."""
    out = set()
    for name, module in placed_lists(model).items():
        prefix = f"{name}." if name else ""
        mine = set(module._modules)
        for key in keys:
            if key.startswith(prefix):
                idx = key[len(prefix):].split(".", 1)[0]
                if idx.isdigit() and idx not in mine:
                    out.add(key)
    return out


@torch.no_grad()
def gather_experts(model: nn.Module, group, values: Optional[Dict[str, torch.Tensor]] = None
                   ) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every rank's experts of every placed list: ``{list name: {state-dict key: tensor}}`` (collective over ``group``:
    one all-gather per list). ``values``: this rank's tensors by key, used in place of the module's own."""
    from lightning_scale.comm import collectives

    lists: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, module in placed_lists(model).items():
        out = lists.setdefault(name, {})
        prefix = f"{name}." if name else ""
        total, n, _ = module._placed
        local = total // n
        first = next(iter(module._modules.values()))
        template = [(k, v.shape, v.dtype) for k, v in first.state_dict().items()]
        rows = []
        for idx, expert in module._modules.items():
            state = expert.state_dict()
            rows.append(torch.cat([(values or {}).get(f"{prefix}{idx}.{k}", state[k]).detach().reshape(-1)
                                   .to(template[0][2]) for k, _, _ in template]))
        mine = torch.stack(rows)
        gathered = torch.empty((n * local, mine.shape[1]), dtype=mine.dtype, device=mine.device)
        collectives.all_gather(gathered.view(-1), mine.reshape(-1), group, tag="tp/consolidate")
        for e in range(total):
            start = 0
            for k, shape, dtype in template:
                size = int(torch.Size(shape).numel())
                out[f"{prefix}{e}.{k}"] = gathered[e, start:start + size].view(shape).to(dtype).clone()
                start += size
    return lists
