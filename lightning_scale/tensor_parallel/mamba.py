"""Tensor parallelism inside a Mamba-2 mixer (style ``mamba2``): its heads and groups split over tp, Megatron's way.

transformers' Mamba-2 mixers (Bamba, Nemotron-H, Falcon-H1, Granite 4 hybrid; ``*Mixer`` with ``in_proj``, a depthwise
``conv1d``, ``A_log`` / ``D`` / ``dt_bias`` per head, a gated RMSNorm over groups and ``out_proj``) compute, per head,
a selective scan that reads only that head's channels and its group's ``B`` / ``C``. With tp dividing the heads and
the groups, each rank keeps whole heads and whole groups:

* ``in_proj`` rows ``[z | x | B | C | dt]`` (``d, d, G*N, G*N, H``), each part cut over tp (its bias too, and a
  buffer of that width such as Falcon-H1's ``mup_vector``);
* ``conv1d`` channels ``[x | B | C]`` (depthwise: a channel reads only itself), its bias too;
* ``A_log``, ``D``, ``dt_bias`` (one per head) and the gated norm's weight (``d``: its groups of ``d / G`` stay
  whole on a rank) cut over tp;
* ``out_proj`` by columns, with no reduction inside: the mixer is one region, its floating inputs' gradients summed
  over tp on the way in (``copy_to_region``) and its output summed over tp on the way out (``reduce_from_region``).
  So the fused training kernel (``mamba_ssm``'s ``mamba_split_conv1d_scan_combined``, which applies ``out_proj``
  itself) is summed as well as the torch path. A bias of ``out_proj`` is added by tp rank 0 only (the other ranks
  read ``b - b.detach()``: zero, with the whole gradient).

The module's head, width and group counts (``num_heads``, ``intermediate_size``, ``n_groups``, ``conv_dim``, ...) and its
``conv1d`` channel counts become the local ones, so the same forward runs on the slices. Every parameter is split,
so nothing else needs a gradient sum. Left whole (named in the startup table's ``tensor parallel`` row): a mixer
whose groups or heads tp does not divide (Megatron requires the same: ``n_groups % tp == 0``; most released Bamba,
Falcon-H1 and Granite 4 checkpoints have one group).
"""

from __future__ import annotations

import types
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from lightning_scale.tensor_parallel.experts import _enter, _leave, add_bias_once, keep_local
from lightning_scale.tensor_parallel.mappings import tp_rank
from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec, mark_sharded, shard_tensor

_ATTRS = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim")
_PER_HEAD = ("A_log", "D", "dt_bias")
# the mixer's attributes holding a count that becomes the local one (divided by tp)
_LOCAL_COUNTS = ("num_heads", "intermediate_size", "n_groups", "conv_dim", "groups_time_state_size")


def is_mamba2_mixer(module: nn.Module) -> bool:
    """A transformers Mamba-2 mixer: the attributes and parameters its forward reads."""
    if not all(isinstance(getattr(module, a, None), int) for a in _ATTRS):
        return False
    if not all(isinstance(getattr(module, p, None), nn.Parameter) for p in _PER_HEAD):
        return False
    return (type(getattr(module, "in_proj", None)) is nn.Linear and type(getattr(module, "out_proj", None)) is nn.Linear
            and isinstance(getattr(module, "conv1d", None), nn.Conv1d))


def _parts(module: nn.Module):
    d, gn, h = module.intermediate_size, module.n_groups * module.ssm_state_size, module.num_heads
    return (d, d, gn, gn, h), (d, gn, gn)


def unsupported(module: nn.Module, tp: int) -> Optional[str]:
    """Why ``mamba2`` cannot split ``module`` over ``tp`` ranks (None when it can)."""
    kind = type(module).__name__
    if not is_mamba2_mixer(module):
        return f"{kind} is not a transformers Mamba-2 mixer (in_proj, conv1d, A_log / D / dt_bias, out_proj)"
    proj, conv = _parts(module)
    h, g = module.num_heads, module.n_groups
    if module.intermediate_size != h * module.head_dim:
        return f"{kind}: intermediate_size {module.intermediate_size} is not num_heads x head_dim ({h} x {module.head_dim})"
    if module.in_proj.out_features != sum(proj) or module.conv1d.in_channels != sum(conv) or (
            module.conv1d.groups != module.conv1d.in_channels):
        return f"{kind}: in_proj / conv1d are not the Mamba-2 layout [z | x | B | C | dt] / depthwise [x | B | C]"
    if h % tp or g % tp:
        return (f"{kind}: tp={tp} does not divide its {g} group(s) and {h} heads (each rank keeps whole groups, as "
                f"Megatron's Mamba: n_groups % tp == 0)")
    norm = getattr(module, "norm", None)
    if norm is not None and not isinstance(norm, nn.Identity):
        w = getattr(norm, "weight", None)
        if not isinstance(w, nn.Parameter) or w.shape != (module.intermediate_size,):
            return f"{kind}: its norm ({type(norm).__name__}) has no weight over the intermediate width"
    return None


def mixer_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    """The shard spec of every parameter of the mixer over ``tp`` ranks; ValueError naming why it cannot be split."""
    why = unsupported(module, tp)
    if why is not None:
        raise ValueError(f"style 'mamba2' on {name!r}: {why}")
    proj, conv = _parts(module)
    specs = {"in_proj.weight": make_spec(0, sum(proj), tp, parts=proj, what=f"{name}.in_proj")}
    if module.in_proj.bias is not None:
        specs["in_proj.bias"] = make_spec(0, sum(proj), tp, parts=proj, what=f"{name}.in_proj.bias")
    specs["conv1d.weight"] = make_spec(0, sum(conv), tp, parts=conv, what=f"{name}.conv1d")
    if module.conv1d.bias is not None:
        specs["conv1d.bias"] = make_spec(0, sum(conv), tp, parts=conv, what=f"{name}.conv1d.bias")
    for p in _PER_HEAD:
        specs[p] = make_spec(0, module.num_heads, tp, what=f"{name}.{p}")
    norm = getattr(module, "norm", None)
    if isinstance(getattr(norm, "weight", None), nn.Parameter):
        specs["norm.weight"] = make_spec(0, module.intermediate_size, tp, what=f"{name}.norm")
    specs["out_proj.weight"] = make_spec(1, module.intermediate_size, tp, what=f"{name}.out_proj")
    return specs


@torch.no_grad()
def localize(module: nn.Module, specs: Dict[str, ShardSpec], tp: int, rank: int) -> None:
    """Keep this rank's slice of every parameter under ``specs`` (meta stays meta), of every buffer as wide as the
    in_proj output, and make the module's counts local. No hook, no group (the memory plan's local view uses it)."""
    proj_spec = specs["in_proj.weight"]
    width = proj_spec.size
    for bname, buf in list(module.named_buffers(recurse=False)):  # Falcon-H1's mup_vector: one factor per in_proj row
        if buf is not None and buf.dim() >= 1 and buf.shape[-1] == width:
            spec = ShardSpec(dim=buf.dim() - 1, size=width, tp=tp, padded=width, sections=proj_spec.sections,
                             parts=proj_spec.parts)
            local = (torch.empty(spec.local_shape(buf.shape), device="meta", dtype=buf.dtype) if buf.is_meta
                     else shard_tensor(buf, spec, rank).contiguous())
            persistent = bname not in module._non_persistent_buffers_set
            module.register_buffer(bname, local, persistent=persistent)
    for pname, spec in specs.items():
        owner_name, _, leaf = pname.rpartition(".")
        keep_local(module.get_submodule(owner_name) if owner_name else module, leaf, spec, rank)
    for attr in _LOCAL_COUNTS:
        value = module.__dict__.get(attr)
        if isinstance(value, int):
            setattr(module, attr, value // tp)
    norm = getattr(module, "norm", None)
    if isinstance(norm.__dict__.get("n_groups") if norm is not None else None, int):  # Falcon-H1's gated norm
        norm.n_groups //= tp
    conv = module.conv1d
    conv.in_channels = conv.out_channels = conv.groups = module.conv_dim
    module.in_proj.out_features = module.in_proj.weight.shape[0]
    module.out_proj.in_features = module.out_proj.weight.shape[1]


def _apply(self, fn, recurse=True):
    """``nn.Module._apply``, then the split parameters marked again (``.to_empty()`` from meta builds new ones)."""
    out = type(self)._apply(self, fn, recurse)
    for pname, spec in self._tp_mamba_specs.items():
        mark_sharded(self.get_parameter(pname), spec)
    return out


def split_mixer(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group) -> List[object]:
    """Keep this rank's heads and groups of ``module`` (in place: same module, same parameter names) and draw the
    region around it. Returns the hook handles."""
    rank = tp_rank(group)
    localize(module, specs, torch.distributed.get_world_size(group), rank)
    module._tp_mamba_specs = dict(specs)
    module._apply = types.MethodType(_apply, module)
    if rank > 0 and module.out_proj.bias is not None:
        add_bias_once(module, "out_proj", "bias")
    tag = f"tp/{name}"
    return [module.register_forward_pre_hook(_enter(group, tag), with_kwargs=True),
            module.register_forward_hook(_leave(group, tag, name), with_kwargs=True)]


def mixer_plan_entries(model: nn.Module, covered, tp: int):
    """(entries to add to a Hugging Face model's built-in plan, mixers left whole -> why): ``mamba2`` for every Mamba-2
    mixer no entry covers (nor its projections) that tp can split."""
    from lightning_scale.tensor_parallel.plan import _generic

    add: Dict[str, str] = {}
    whole: Dict[str, str] = {}
    for name, module in model.named_modules():
        if not name or not is_mamba2_mixer(module) or covered(name):
            continue
        if any(covered(f"{name}.{c}") for c in ("in_proj", "out_proj", "conv1d")):
            continue
        why = unsupported(module, tp)
        if why is not None:
            whole.setdefault(_generic(name), why)
            continue
        add[name] = "mamba2"  # by name: a hybrid may hold attention under the same attribute (Nemotron-H's mixer)
    return add, whole
