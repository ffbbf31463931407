"""Tensor parallelism inside a mixture-of-experts layer: every expert's intermediate width split over tp.

transformers (5.x) keeps a MoE layer's experts as 3-D parameters of one module (``MixtralExperts``,
``Qwen2MoeExperts``, ...: ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)), decorated with
``use_experts_implementation``, which records the layout on the instance (``is_transposed``,
``is_concatenated``, ``has_gate``, ``has_bias``, ``has_post_expert_norm``). The models' own tensor-parallel plans
leave those modules whole (Mixtral's splits its attention only: 16% of the parameters at tp=2); transformers'
expert-parallel plans need a token dispatch (``ep_dispatch_experts``) this package does not build.

Style ``experts`` splits them the Megatron way, inside every expert: the gate / up projection column-parallel
(``[gate | up]`` as two fused sections, each cut over tp), the down projection row-parallel. Every rank routes every
token alike (the router stays whole and sees the same input), runs its slice of each chosen expert, and one
all-reduce of the module's output sums the slices: the routing weight multiplies an expert's output, a linear
step, so it applies to each slice. Backward: the gradients of the module's floating inputs (the hidden states and
the routing weights) are partial on each rank and are all-reduced (``copy_to_region``), so the router's and the
earlier layers' gradients come out whole. Exact up to the order of the sum; the same ``experts_implementation``
(eager, grouped_mm, batched_mm) runs on the local slices.

The built-in Hugging Face plan adds ``experts`` for every such module tp can split, and splits the gated MLP next
to it (Qwen2-MoE's ``shared_expert``) column / row-wise. Left whole (the startup table's ``tensor parallel`` row
shows what stays whole): a norm after each expert (not linear), and experts whose intermediate width tp does not
divide (a user's own plan naming such a module with ``experts`` gets a ConfigError).

Expert biases (GPT-OSS: ``gate_up_proj_bias`` (E, 2I), ``down_proj_bias`` (E, H)): the gate / up bias is cut with
its columns; the down projection's bias is added by tp rank 0 only. The other ranks' forward reads ``b - b.detach()``
in its place (exactly zero, gradient one), so every rank's bias gets the whole gradient (the output's gradient is the
same on every rank, and so is the routing) and the copies stay equal without a collective.

DBRX keeps its experts in one ``mlp`` module as 2-D parameters ``w1`` / ``v1`` / ``w2`` of (E * I, H) rows (gate,
up, down; the down projection stored transposed) and reads I from ``ffn_hidden_size``: each expert's I rows are cut
over tp (E fused sections) and the module's ``ffn_hidden_size`` becomes the local width.

The same style splits a mixture-of-experts *block* that holds its router: a ``gate`` and an ``experts`` list of MLP
modules (litgpt's ``LLaMAMoE``, with its optional ``shared_experts``; also the per-expert ``w1 / w3 / w2`` layout
older transformers saved). Every expert's and the shared expert's up projections are cut by rows, the down
projection by columns; the gate stays whole. The block's input reaches both the gate and the experts, so the region
is drawn around the experts only: the block's floating inputs enter it (their gradient all-reduced), the gate's
input gradient is scaled by ``1 / tp`` before that sum (the gate path is whole on every rank: the sum gives it back
once), and the gate's floating outputs (router logits, or the routing weights of a grouped router) enter the region
again, so their partial gradients are summed before the gate's backward. One all-reduce of the block's output sums
the experts' slices. Exact for tp a power of two (halving and summing whole values is exact).
"""

from __future__ import annotations

import types
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from lightning_scale.tensor_parallel.mappings import copy_to_region, reduce_from_region, tp_rank
from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec, mark_sharded, shard_tensor

_LAYOUT_ATTRS = ("is_transposed", "has_gate", "has_bias")


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module (3-D expert weights, layout recorded by ``use_experts_implementation``)."""
    return (all(isinstance(getattr(module, a, None), bool) for a in _LAYOUT_ATTRS)
            and isinstance(getattr(module, "down_proj", None), nn.Parameter) and module.down_proj.dim() == 3)


_FUSED = ("w1", "v1", "w2")  # DBRX's gate, up and down projections of every expert, (E * I, H) each


def is_fused_experts(module: nn.Module) -> bool:
    """DBRX's experts module: an ``mlp`` holding every expert's weights as 2-D ``w1`` / ``v1`` / ``w2`` of
    ``num_experts * ffn_hidden_size`` rows."""
    mlp, e, i = getattr(module, "mlp", None), getattr(module, "num_experts", None), getattr(module, "ffn_hidden_size",
                                                                                            None)
    if not isinstance(mlp, nn.Module) or not isinstance(e, int) or not isinstance(i, int):
        return False
    ws = [getattr(mlp, n, None) for n in _FUSED]
    return all(isinstance(w, nn.Parameter) and w.dim() == 2 and w.shape[0] == e * i for w in ws) and (
        getattr(mlp, "ffn_hidden_size", i) == i)


def _up_name(module: nn.Module) -> str:
    return "gate_up_proj" if module.has_gate else "up_proj"


# A per-expert MLP's linear layers: (up projections, cut by rows; the down projection, cut by columns)
_MLP_LAYOUTS = ((("fc_1", "fc_2"), "proj"),  # litgpt LLaMAMLP / GemmaMLP
                (("fc",), "proj"),  # litgpt GptNeoxMLP
                (("gate_proj", "up_proj"), "down_proj"),  # Hugging Face gated MLPs
                (("w1", "w3"), "w2"),  # Mixtral's experts as older transformers built them
                (("up_proj",), "down_proj"))  # Hugging Face MLPs without a gate (Nemotron-H's ReLU^2 layers)
_SHARED = ("shared_experts", "shared_expert")


def _mlp_layout(module: nn.Module) -> Optional[Tuple[Tuple[str, ...], str]]:
    for ups, down in _MLP_LAYOUTS:
        if all(type(getattr(module, n, None)) is nn.Linear for n in (*ups, down)):
            return ups, down
    return None


def is_moe_block(module: nn.Module) -> bool:
    """A mixture-of-experts block holding its router: a ``gate`` module and an ``experts`` list of MLPs."""
    experts = getattr(module, "experts", None)
    return (isinstance(getattr(module, "gate", None), nn.Module) and isinstance(experts, nn.ModuleList)
            and len(experts) > 0 and all(_mlp_layout(e) is not None for e in experts))


def _block_mlps(module: nn.Module) -> Dict[str, nn.Module]:
    """prefix -> MLP of every expert (``experts.i``) and the shared expert of a MoE block."""
    mlps = {f"experts.{i}": e for i, e in enumerate(module.experts)}
    for name in _SHARED:
        if getattr(module, name, None) is not None:
            mlps[name] = getattr(module, name)
    return mlps


def _block_unsupported(module: nn.Module) -> Optional[str]:
    kind = type(module).__name__
    known = {"gate", "experts", *_SHARED}
    other = [n for n, _ in module.named_children() if n not in known]
    if other:
        return f"{kind} has modules besides its gate, experts and shared expert ({', '.join(other)})"
    for name in _SHARED:
        shared = getattr(module, name, None)
        if shared is not None and _mlp_layout(shared) is None:
            return f"{kind}.{name} ({type(shared).__name__}) is not an MLP of linear layers"
    for prefix, mlp in _block_mlps(module).items():
        ups, down = _mlp_layout(mlp)
        if getattr(mlp, down).bias is not None:
            return f"{kind}.{prefix}.{down} has a bias (it would be added once per tp rank)"
        if len({getattr(mlp, n).out_features for n in ups}) != 1:
            return f"{kind}.{prefix}: its up projections {ups} have different widths"
    return None


def unsupported(module: nn.Module) -> Optional[str]:
    """Why ``experts`` cannot split ``module`` (None when it can)."""
    if is_moe_block(module):
        return _block_unsupported(module)
    if is_fused_experts(module):
        return None
    if not is_experts(module):
        return (f"{type(module).__name__} is not a transformers experts module (3-D gate_up_proj / down_proj "
                f"weights with the layout use_experts_implementation records) nor a mixture-of-experts block "
                f"(a gate and an experts list of MLPs)")
    if getattr(module, "has_post_expert_norm", False):
        return f"{type(module).__name__} normalizes each expert's output (not linear in the split)"
    up = getattr(module, _up_name(module), None)
    if not isinstance(up, nn.Parameter) or up.dim() != 3:
        return f"{type(module).__name__} has no 3-D {_up_name(module)}"
    return None


def expert_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    """The shard spec of each expert weight of ``module`` over ``tp`` ranks; ValueError naming the width tp does not
    divide, or why the module cannot be split."""
    why = unsupported(module)
    if why is not None:
        raise ValueError(f"style 'experts' on {name!r}: {why}")
    if is_moe_block(module):
        return _block_specs(name, module, tp)
    if is_fused_experts(module):
        e, width = module.num_experts, module.ffn_hidden_size
        if width % tp:
            raise ValueError(f"tp={tp} does not divide the intermediate width {width} (ffn_hidden_size) of the "
                             f"experts {name!r}")
        return {f"mlp.{n}": make_spec(0, e * width, tp, sections=e, what=f"{name}.mlp.{n}") for n in _FUSED}
    up_name = _up_name(module)
    up, down = getattr(module, up_name), module.down_proj
    up_dim, down_dim = (2, 1) if module.is_transposed else (1, 2)
    width = down.shape[down_dim]  # the intermediate width I
    gated_fused = module.has_gate and getattr(module, "is_concatenated", True)
    if width % tp:
        raise ValueError(f"tp={tp} does not divide the intermediate width {width} of the experts {name!r}")
    # [gate | up]: two sections, each cut over tp; interleaved [g0, u0, g1, u1, ...]: a contiguous cut (I % tp == 0
    # keeps every pair on one rank); no gate: the up projection's I rows
    up_spec = make_spec(up_dim, up.shape[up_dim], tp, sections=2 if gated_fused else 1, what=f"{name}.{up_name}")
    down_spec = make_spec(down_dim, width, tp, what=f"{name}.down_proj")
    specs = {up_name: up_spec, "down_proj": down_spec}
    if module.has_bias:  # the up bias (E, 2I or I) cut with its columns; the down bias (E, H) stays whole
        specs[f"{up_name}_bias"] = make_spec(1, up.shape[up_dim], tp, sections=2 if gated_fused else 1,
                                             what=f"{name}.{up_name}_bias")
    return specs


def _block_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    specs: Dict[str, ShardSpec] = {}
    for prefix, mlp in _block_mlps(module).items():
        ups, down = _mlp_layout(mlp)
        width = getattr(mlp, down).in_features
        if width % tp:
            raise ValueError(f"tp={tp} does not divide the intermediate width {width} of {name}.{prefix}")
        for n in ups:
            lin = getattr(mlp, n)
            specs[f"{prefix}.{n}.weight"] = make_spec(0, lin.out_features, tp, what=f"{name}.{prefix}.{n}")
            if lin.bias is not None:
                specs[f"{prefix}.{n}.bias"] = make_spec(0, lin.out_features, tp, what=f"{name}.{prefix}.{n}.bias")
        specs[f"{prefix}.{down}.weight"] = make_spec(1, width, tp, what=f"{name}.{prefix}.{down}")
    return specs


def _apply(self, fn, recurse=True):
    """``nn.Module._apply``, then the expert weights marked again: ``.to_empty()`` from meta builds new Parameters.
    Installed per instance (module-level, so the split model still pickles and deep-copies)."""
    out = type(self)._apply(self, fn, recurse)
    for pname, spec in self._tp_expert_specs.items():
        mark_sharded(self.get_parameter(pname), spec)
    return out


def add_bias_once(module: nn.Module, owner: str, leaf: str) -> None:
    """On a tp rank > 0: ``module``'s forward reads the bias ``owner.leaf`` (``owner`` a submodule name, "" for the
    module) as ``b - b.detach()``: zero, with b's whole gradient, so only rank 0 adds it to a sum over tp and every
    rank's copy gets the same gradient (the output's gradient and the rest of the forward are the same on every
    rank). Installed per instance (a module-level function, so the split model still pickles and deep-copies)."""
    module._tp_bias_once = (owner, leaf)
    module.forward = types.MethodType(_forward_adding_bias_once, module)


def _forward_adding_bias_once(self, *args, **kwargs):
    owner_name, leaf = self._tp_bias_once
    owner = self.get_submodule(owner_name) if owner_name else self
    bias = owner._parameters[leaf]
    owner._parameters[leaf] = bias - bias.detach()
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        owner._parameters[leaf] = bias


def _enter(group, tag: str):
    def hook(module, args, kwargs):  # every floating input that carries a gradient: partial here, summed over tp
        def enter(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
                return copy_to_region(x, group, tag=tag)
            return x

        return tuple(enter(a) for a in args), {k: enter(v) for k, v in kwargs.items()}

    return hook


def _leave(group, tag: str, name: str):
    def hook(module, args, kwargs, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"tensor-parallel experts {name!r} must return one tensor, got {type(output).__name__}")
        return reduce_from_region(output, group, tag=tag)

    return hook


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _gate_hooks(gate: nn.Module, group, tag: str) -> List[object]:
    """The router of a MoE block inside the experts' region: its input gradient (whole on every rank) scaled by
    1 / tp before the region's sum, its floating outputs' gradients (partial: they weight the experts' slices)
    summed over tp."""
    scale = 1.0 / torch.distributed.get_world_size(group)

    def enter(module, args):
        return tuple(_ScaleGrad.apply(a, scale) if isinstance(a, torch.Tensor) and a.is_floating_point()
                     and a.requires_grad else a for a in args)

    def leave(module, args, output):
        def one(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
                return copy_to_region(x, group, tag=tag)
            return x

        return type(output)(one(o) for o in output) if isinstance(output, tuple) else one(output)

    return [gate.register_forward_pre_hook(enter), gate.register_forward_hook(leave)]


@torch.no_grad()
def keep_local(owner: nn.Module, leaf: str, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Replace ``owner.<leaf>`` by this rank's piece of it under ``spec``, a marked Parameter (meta stays meta)."""
    full = getattr(owner, leaf)
    if full.is_meta:
        local = torch.empty(spec.local_shape(full.shape), device="meta", dtype=full.dtype)
    else:
        local = shard_tensor(full.detach(), spec, rank)
    param = nn.Parameter(local, requires_grad=full.requires_grad)
    mark_sharded(param, spec)
    setattr(owner, leaf, param)
    return local


@torch.no_grad()
def split_experts(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group) -> List[object]:
    """Keep this rank's slice of every expert weight of ``module`` (in place: same module, same parameter names;
    meta stays meta) and install the region hooks. Returns the hook handles."""
    rank = tp_rank(group)
    for pname, spec in specs.items():
        owner_name, _, leaf = pname.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        local = keep_local(owner, leaf, spec, rank)
        if isinstance(owner, nn.Linear) and leaf == "weight":  # the local widths, as the parallel linears keep them
            owner.out_features, owner.in_features = local.shape
    module._tp_expert_specs = dict(specs)
    module._apply = types.MethodType(_apply, module)
    if set(specs) == {f"mlp.{n}" for n in _FUSED}:  # DBRX: its forward views the rows as (E, ffn_hidden_size, H)
        local = module.mlp.w1.shape[0] // module.num_experts
        module.ffn_hidden_size = local
        if hasattr(module.mlp, "ffn_hidden_size"):
            module.mlp.ffn_hidden_size = local
    if rank > 0 and getattr(module, "has_bias", False) and isinstance(getattr(module, "down_proj_bias", None),
                                                                      nn.Parameter):
        add_bias_once(module, "", "down_proj_bias")
    tag = f"tp/{name}"
    handles = [module.register_forward_pre_hook(_enter(group, tag), with_kwargs=True),
               module.register_forward_hook(_leave(group, tag, name), with_kwargs=True)]
    if is_moe_block(module):
        handles += _gate_hooks(module.gate, group, tag)
    return handles


def _gated_mlp(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def expert_plan_entries(model: nn.Module, covered, tp: int,
                        placed: bool = False) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(entries to add to a Hugging Face model's built-in plan, experts modules left whole -> why). ``covered``:
    whether a module name is matched by the plan already. Every experts module tp can split gets ``experts``
    (``placed``: every one tp can place whole experts of gets ``expert_parallel``,
    :mod:`~lightning_scale.tensor_parallel.expert_parallel`); a gated MLP beside it in the same MoE block (a shared
    expert), unplanned, gets colwise / colwise / rowwise."""
    from lightning_scale.tensor_parallel.expert_parallel import placed_specs
    from lightning_scale.tensor_parallel.plan import _generic  # one naming of layer patterns

    add: Dict[str, str] = {}
    whole: Dict[str, str] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not name or covered(name) or not (is_experts(module) or is_fused_experts(module)):
            continue
        try:
            (placed_specs if placed else expert_specs)(name, module, tp)
        except ValueError as err:
            whole.setdefault(_generic(name), str(err))
            continue
        add[_generic(name)] = "expert_parallel" if placed else "experts"
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        for child, sub in modules[parent].named_children() if parent in modules else ():
            full = f"{parent}.{child}" if parent else child
            if sub is module or not _gated_mlp(sub) or any(covered(f"{full}.{p}") for p in ("gate_proj", "up_proj")):
                continue
            if sub.up_proj.out_features % tp:
                continue
            pattern = _generic(full)
            add.update({f"{pattern}.gate_proj": "colwise", f"{pattern}.up_proj": "colwise",
                        f"{pattern}.down_proj": "rowwise"})
    return add, whole
