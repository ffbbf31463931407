"""Local views of a tensor-parallel plan for the memory plan (``strategies/memory_plan._profile``): what one tp rank
holds, on ``meta``, with no group, hook or collective, so a decoder layer can be profiled on fake tensors as it runs
there. :func:`local_linears` views a live split model; :func:`local_on_meta` makes an unsplit meta model (rebuilt from
its config where the live units cannot run alone: ZeRO-3's flat shards, the sp exchange) into it."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional

import torch
import torch.nn as nn

from lightning_scale.tensor_parallel import experts, mamba
from lightning_scale.tensor_parallel.hf import LocalHeadsConfig
from lightning_scale.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, dense_features
from lightning_scale.tensor_parallel.plan import plan_tensor_parallel
from lightning_scale.tensor_parallel.routed_experts import route_experts


@contextlib.contextmanager
def local_linears(model: nn.Module) -> Iterator[None]:
    """Inside: every tensor-parallel linear of ``model`` replaced by an ``nn.Linear`` of this rank's local shape on
    ``meta`` (no collective, no memory), so a split decoder layer can be profiled on fake tensors as it runs here (the
    memory plan, ``strategies/memory_plan._profile``): its attention already uses the local heads. A layer whose forward
    still reaches a collective (a gradient all-reduce hook) fails the profile and is counted instead. Restored on
    exit."""
    swapped = []
    for name, m in list(model.named_modules()):
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            in_f, out_f = m.local_features
            swapped.append((name, m))
            model.set_submodule(name, nn.Linear(in_f, out_f, bias=m.bias is not None, device="meta",
                                                dtype=torch.float32))
    try:
        yield
    finally:
        for name, m in swapped:
            model.set_submodule(name, m)


@torch.no_grad()
def local_on_meta(model: nn.Module, plan: Optional[Dict[str, object]], tp: int, *,
                  expert_parallel: bool = False) -> nn.Module:
    """``model`` (unsplit, on meta) made, in place, into what one tp rank of ``plan`` holds, with no group, hook or
    collective: every split linear an ``nn.Linear`` of its local shape, every split expert / norm weight its local
    slice (placed experts: ``E / tp`` of them; ``expert_data_parallel``: the ep layout), the attentions' head counts
    local. What the memory plan profiles when
    the live units cannot run alone (ZeRO-3's flat shards, the sp exchange); :func:`local_linears` is the same view of
    a live split model."""
    route_experts(model)
    p = plan_tensor_parallel(model, plan, tp, expert_parallel=expert_parallel)
    for act in p.actions:
        if act.style.shards_linear and act.weight_spec is not None:
            in_f, out_f, transposed = dense_features(act.module)
            shape = act.weight_spec.local_shape((in_f, out_f) if transposed else (out_f, in_f))
            in_l, out_l = (shape[0], shape[1]) if transposed else (shape[1], shape[0])
            bias = getattr(act.module, "bias", None) is not None
            model.set_submodule(act.name, nn.Linear(in_l, out_l, bias=bias, device="meta", dtype=torch.float32))
        elif act.style.kind == "vocab" and act.weight_spec is not None:
            emb = act.module
            model.set_submodule(act.name, nn.Embedding(act.weight_spec.local_size, emb.embedding_dim, device="meta"))
        elif act.style.kind == "mamba":
            mamba.localize(act.module, act.param_specs, tp, 0)
        elif act.style.kind in ("experts", "expert_parallel", "expert_data_parallel", "norm_split", "head_params"):
            for pname, spec in act.param_specs.items():
                owner_name, _, leaf = pname.rpartition(".")
                experts.keep_local(act.module.get_submodule(owner_name) if owner_name else act.module, leaf, spec, 0)
            if act.style.kind in ("expert_parallel", "expert_data_parallel"):
                act.module.num_experts //= tp
                act.module._tp_expert_parallel = tp  # the memory plan: k / tp of the routes at full width (placed),
                act.module._ep_exchange = act.style.kind == "expert_data_parallel"  # every rank's routes (ep)
    for pname, attrs in p.parent_fixes.items():
        for attr, value in attrs.items():
            setattr(model.get_submodule(pname), attr, value)
    for pname, attrs in p.config_views.items():
        parent = model.get_submodule(pname)
        parent.config = LocalHeadsConfig(parent.config, attrs)
    return model
