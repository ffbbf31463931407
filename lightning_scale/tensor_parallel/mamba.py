"""Tensor parallelism inside a Mamba mixer: Mamba-2 (style ``mamba2``: its heads and groups split over tp, Megatron's
way) and Mamba-1 (style ``mamba1``: its channels split, Jamba's mixers; see the end). The other recurrent layouts,
gated DeltaNet (style ``gated_deltanet``, :mod:`~lightning_scale.tensor_parallel.deltanet`) and short convolutions
(style ``short_conv``, :mod:`~lightning_scale.tensor_parallel.short_conv`), keep their cuts in their own modules; this
module's functions (:func:`mixer_style`, :func:`unsupported`, :func:`mixer_specs`, :func:`local_counts`,
:func:`localize`, :func:`split_mixer`) dispatch to them, for tp and for sequence parallelism
(:mod:`lightning_scale.sequence_parallel.mamba`) alike.

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
``conv1d`` channel counts become the local ones, so the same forward runs on the slices.

**Fewer groups than ranks** (``tp % n_groups == 0``: the released Bamba, Falcon-H1 and Granite 4 hybrids have one
group; Megatron refuses them, ``n_groups % tp == 0``). Rank r keeps heads ``r*H/tp ...``, which all read group
``g = r*G // tp``, and a copy of that group's ``B`` / ``C`` rows (the ``splits`` of the kv-heads-below-tp layout,
:class:`~lightning_scale.tensor_parallel.sharding.ShardSpec`): in_proj's and conv1d's B / C rows are replicated over the
``tp / G`` ranks sharing the group, and their gradients (each rank's from its own heads only) are summed over those
ranks in the backward (:func:`~lightning_scale.tensor_parallel.layers.replica_grad_sum`; the grad norm counts them
once, a checkpoint takes them from the first holder). The gated RMSNorm normalizes over a whole group (``d / G``
channels) that now spans ``tp / G`` ranks: its sum of squares is summed over them (forward and backward) and the rest
is per channel. The fused training kernel (``mamba_split_conv1d_scan_combined``, GPU) normalizes inside and cannot
see the other ranks' channels, so such a mixer takes the unfused path (kernels for the conv and the scan still apply):
the mixer reads ``training=False`` during its forward, the only thing that flag selects there.

Left whole (named in the startup table's ``tensor parallel`` row): a mixer whose heads tp does not divide, or whose
groups tp neither divides nor is a multiple of, or with a gated norm of an unknown form.

**Mamba-1** (transformers' Jamba mixer: ``in_proj`` to ``[x | z]``, a depthwise ``conv1d``, ``x_proj`` from the
channels to ``[dt | B | C]`` (rank R, N, N), ``dt_proj`` back to the channels, ``A_log`` (d, N), ``D`` and
``out_proj``; Jamba adds RMSNorms on dt, B and C). Every channel's selective scan reads its own channel and the shared
``dt`` / ``B`` / ``C``; so each rank keeps d / tp channels: in_proj's rows per part, conv1d's channels, ``x_proj``'s
columns (its output is then a partial sum: all-reduced over tp, and its gradient too, since each rank's channels use
it), ``dt_proj``'s rows and bias, ``A_log`` / ``D``'s rows, ``out_proj``'s columns (the region's sum on the way out,
as above). What stays whole inside the mixer (Jamba's dt / B / C norms) sits on the all-reduced values and feeds
only this rank's channels: its gradients are summed over tp in the backward
(:func:`~lightning_scale.tensor_parallel.grads.install_grad_allreduce`). Megatron and vLLM split Mamba-1 the same way.
"""

from __future__ import annotations

import types
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

import torch.nn.functional as F

from lightning_scale.tensor_parallel import deltanet, kda, short_conv
from lightning_scale.tensor_parallel.experts import _enter, _leave, add_bias_once, keep_local
from lightning_scale.tensor_parallel.grads import install_grad_allreduce
from lightning_scale.tensor_parallel.layers import replica_grad_sum
from lightning_scale.tensor_parallel.mappings import _reduce, tp_rank
from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec, mark_sharded, shard_tensor

_ATTRS = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim")
_PER_HEAD = ("A_log", "D", "dt_bias")
# the mixer's attributes holding a count that becomes the local one (divided by tp)
_LOCAL_COUNTS = ("num_heads", "intermediate_size", "n_groups", "groups_time_state_size")
_GROUP_COUNTS = ("n_groups", "groups_time_state_size")  # local: this rank's groups (one when G < tp)


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


def _splits(module: nn.Module, tp: int):
    """(in_proj, conv1d) ``splits`` of :func:`make_spec`: () when tp divides the groups, else the B / C parts cut in
    ``n_groups`` pieces only (each replicated over the ``tp / G`` ranks whose heads read it)."""
    g = module.n_groups
    if g % tp == 0:
        return (), ()
    return (tp, tp, g, g, tp), (tp, g, g)


def norm_kind(norm) -> Optional[str]:
    """The gated RMSNorm forms whose group statistics this module can sum over ranks: transformers' ``group_size``
    one (Mamba-2, Bamba, Nemotron-H, Granite 4: gate, then norm per group, weight after the cast) and Falcon-H1's
    (``n_groups``, ``norm_before_gate``, weight before the cast). None for anything else."""
    if norm is None or isinstance(norm, nn.Identity):
        return "none"
    if not type(norm).__name__.endswith("RMSNormGated") or not isinstance(getattr(norm, "variance_epsilon", None), float):
        return None
    if isinstance(norm.__dict__.get("group_size"), int):
        return "group_size"
    if isinstance(norm.__dict__.get("n_groups"), int) and isinstance(norm.__dict__.get("norm_before_gate"), bool):
        return "falcon_h1"
    return None


_M1_LINEARS = ("in_proj", "x_proj", "dt_proj", "out_proj")
_M1_SPLIT = ("in_proj", "x_proj", "dt_proj", "out_proj", "conv1d")  # submodules whose parameters are cut


def is_mamba1_mixer(module: nn.Module) -> bool:
    """A transformers Mamba-1 mixer (Jamba's): the submodules and parameters its forward reads."""
    if not isinstance(getattr(module, "intermediate_size", None), int) or is_mamba2_mixer(module):
        return False
    if not all(type(getattr(module, n, None)) is nn.Linear for n in _M1_LINEARS):
        return False
    return (isinstance(getattr(module, "conv1d", None), nn.Conv1d) and isinstance(getattr(module, "A_log", None),
                                                                                   nn.Parameter)
            and isinstance(getattr(module, "D", None), nn.Parameter))


# recurrent layers cut the same way whose layouts live in their own modules: style -> (detector, layout module)
OTHER_LAYOUTS = {"gated_deltanet": (deltanet.is_gated_deltanet, deltanet),
                 "short_conv": (short_conv.is_short_conv, short_conv),
                 "kimi_delta": (kda.is_kimi_delta, kda)}


def out_name(module: nn.Module, style: Optional[str]) -> str:
    """The output projection of a recurrent layer of ``style`` (``out_proj``; OLMo hybrid's gated DeltaNet and Kimi
    delta attention: ``o_proj``)."""
    if style == "gated_deltanet":
        return deltanet.out_name(module)
    return "o_proj" if style == "kimi_delta" else "out_proj"


def mixer_style(module: nn.Module) -> Optional[str]:
    """The style that splits ``module`` (``mamba2`` / ``mamba1`` / ``gated_deltanet`` / ``short_conv``), None for
    anything else."""
    if is_mamba2_mixer(module):
        return "mamba2"
    if is_mamba1_mixer(module):
        return "mamba1"
    return next((style for style, (found, _) in OTHER_LAYOUTS.items() if found(module)), None)


def unsupported(module: nn.Module, tp: int, style: str = "", setting: str = "tp") -> Optional[str]:
    """Why style ``style`` (default: the module's own kind) cannot split ``module`` over ``tp`` ranks (None when it
    can); ``setting``: the name the message gives the rank count (``sp`` when sequence parallelism splits it)."""
    kind = type(module).__name__
    own = mixer_style(module)
    if own is None or (style and style != own):
        wanted = style or "mamba2"
        what = {"gated_deltanet": "a transformers gated DeltaNet layer (Qwen3-Next, Qwen 3.5, OLMo hybrid)",
                "kimi_delta": "a transformers Kimi delta attention layer (Kimi Linear)",
                "short_conv": "a transformers short gated convolution (LFM2)"}.get(
            wanted, f"a transformers Mamba-{wanted[-1]} mixer (Mamba-2: in_proj, conv1d, A_log / D / dt_bias, out_proj; "
                    f"Mamba-1: in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj)")
        return f"{kind} is not {what}" + (f"; style {own!r} splits it" if own else "")
    if own in OTHER_LAYOUTS:
        return OTHER_LAYOUTS[own][1].unsupported(module, tp, setting)
    if own == "mamba1":
        return _m1_unsupported(module, tp, setting)
    proj, conv = _parts(module)
    h, g = module.num_heads, module.n_groups
    if module.intermediate_size != h * module.head_dim:
        return f"{kind}: intermediate_size {module.intermediate_size} is not num_heads x head_dim ({h} x {module.head_dim})"
    if module.in_proj.out_features != sum(proj) or module.conv1d.in_channels != sum(conv) or (
            module.conv1d.groups != module.conv1d.in_channels):
        return f"{kind}: in_proj / conv1d are not the Mamba-2 layout [z | x | B | C | dt] / depthwise [x | B | C]"
    if h % tp:
        return f"{kind}: {setting}={tp} does not divide its {h} heads"
    if g % tp and tp % g:
        return (f"{kind}: {setting}={tp} neither divides its {g} groups nor is a multiple of them (each rank's heads must "
                f"read one group, or whole groups)")
    norm = getattr(module, "norm", None)
    if norm is not None and not isinstance(norm, nn.Identity):
        w = getattr(norm, "weight", None)
        if not isinstance(w, nn.Parameter) or w.shape != (module.intermediate_size,):
            return f"{kind}: its norm ({type(norm).__name__}) has no weight over the intermediate width"
        if g % tp and norm_kind(norm) is None:
            return (f"{kind}: its gated norm {type(norm).__name__} is of an unknown form (its groups would span ranks "
                    f"at {setting}={tp} > {g} groups)")
    return None


def mixer_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    """The shard spec of every parameter of the mixer over ``tp`` ranks; ValueError naming why it cannot be split."""
    why = unsupported(module, tp)
    if why is not None:
        raise ValueError(f"style {mixer_style(module) or 'mamba2'!r} on {name!r}: {why}")
    style = mixer_style(module)
    if style in OTHER_LAYOUTS:
        return OTHER_LAYOUTS[style][1].specs(name, module, tp)
    if is_mamba1_mixer(module):
        return _m1_specs(name, module, tp)
    proj, conv = _parts(module)
    proj_splits, conv_splits = _splits(module, tp)
    specs = {"in_proj.weight": make_spec(0, sum(proj), tp, parts=proj, splits=proj_splits, what=f"{name}.in_proj")}
    if module.in_proj.bias is not None:
        specs["in_proj.bias"] = make_spec(0, sum(proj), tp, parts=proj, splits=proj_splits,
                                          what=f"{name}.in_proj.bias")
    specs["conv1d.weight"] = make_spec(0, sum(conv), tp, parts=conv, splits=conv_splits, what=f"{name}.conv1d")
    if module.conv1d.bias is not None:
        specs["conv1d.bias"] = make_spec(0, sum(conv), tp, parts=conv, splits=conv_splits,
                                         what=f"{name}.conv1d.bias")
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
    if is_mamba1_mixer(module) or mixer_style(module) in OTHER_LAYOUTS:
        return _localize_params(module, specs, tp, rank)
    proj_spec = specs["in_proj.weight"]
    width = proj_spec.size
    for bname, buf in list(module.named_buffers(recurse=False)):  # Falcon-H1's mup_vector: one factor per in_proj row
        if buf is not None and buf.dim() >= 1 and buf.shape[-1] == width:
            spec = ShardSpec(dim=buf.dim() - 1, size=width, tp=tp, padded=width, sections=proj_spec.sections,
                             parts=proj_spec.parts, splits=proj_spec.splits)
            local = (torch.empty(spec.local_shape(buf.shape), device="meta", dtype=buf.dtype) if buf.is_meta
                     else shard_tensor(buf, spec, rank).contiguous())
            persistent = bname not in module._non_persistent_buffers_set
            module.register_buffer(bname, local, persistent=persistent)
    for pname, spec in specs.items():
        owner_name, _, leaf = pname.rpartition(".")
        keep_local(module.get_submodule(owner_name) if owner_name else module, leaf, spec, rank)
    set_counts(module, local_counts(module, specs, tp))


def local_counts(module: nn.Module, specs: Dict[str, ShardSpec], tp: int) -> Dict[Tuple[str, str], object]:
    """``{(submodule name, attribute): value}``: the counts the mixer's forward reads, as one of ``tp`` ranks holding
    its slices under ``specs`` sees them (the whole mixer's counts in, nothing changed). A Mamba-2 group spread over
    ranks also gets ``norm._tp_full_group`` (the norm's local "group" is this rank's width; split_mixer sums the
    statistics over the sharing ranks, the memory plan's local view runs it as it is, same shapes)."""
    style = mixer_style(module)
    if style in OTHER_LAYOUTS:
        return OTHER_LAYOUTS[style][1].local_counts(module, specs, tp)
    d = module.intermediate_size
    if is_mamba1_mixer(module):
        local = d // tp
        return {("", "intermediate_size"): local, ("conv1d", "in_channels"): local, ("conv1d", "out_channels"): local,
                ("conv1d", "groups"): local, ("in_proj", "out_features"): 2 * local, ("x_proj", "in_features"): local,
                ("dt_proj", "out_features"): local, ("out_proj", "in_features"): local}
    groups = module.n_groups
    local_groups = groups // tp if groups % tp == 0 else 1  # fewer groups than ranks: each rank reads one
    out: Dict[Tuple[str, str], object] = {}
    norm = getattr(module, "norm", None)
    if groups % tp and norm is not None and not isinstance(norm, nn.Identity):
        out["norm", "_tp_full_group"] = d // groups
        if isinstance(norm.__dict__.get("group_size"), int):
            out["norm", "group_size"] = d // tp
    for attr in _LOCAL_COUNTS:
        value = module.__dict__.get(attr)
        if isinstance(value, int):
            out["", attr] = value * local_groups // groups if attr in _GROUP_COUNTS else value // tp
    conv_dim = d // tp + 2 * local_groups * module.ssm_state_size
    if isinstance(module.__dict__.get("conv_dim"), int):
        out["", "conv_dim"] = conv_dim
    if isinstance(norm.__dict__.get("n_groups") if norm is not None else None, int):  # Falcon-H1's gated norm
        out["norm", "n_groups"] = local_groups
    for attr in ("in_channels", "out_channels", "groups"):
        out["conv1d", attr] = conv_dim
    out["in_proj", "out_features"] = specs["in_proj.weight"].local_size
    out["out_proj", "in_features"] = d // tp
    return out


def set_counts(module: nn.Module, counts: Dict[Tuple[str, str], object]) -> Dict[Tuple[str, str], object]:
    """Set ``counts`` (:func:`local_counts`) on ``module``; returns the values they replaced (None: absent)."""
    before = {}
    for (owner, attr), value in counts.items():
        sub = module.get_submodule(owner) if owner else module
        before[owner, attr] = sub.__dict__.get(attr)
        setattr(sub, attr, value)
    return before


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
    tp = torch.distributed.get_world_size(group)
    style = mixer_style(module)
    groups = module.n_groups if style == "mamba2" else None
    localize(module, specs, tp, rank)
    module._tp_mamba_specs = dict(specs)
    module._apply = types.MethodType(_apply, module)
    out = out_name(module, style)
    if rank > 0 and getattr(module, out).bias is not None:
        add_bias_once(module, out, "bias")
    tag = f"tp/{name}"
    hooks = [module.register_forward_pre_hook(_enter(group, tag), with_kwargs=True),
             module.register_forward_hook(_leave(group, tag, name), with_kwargs=True)]
    if style == "mamba1":
        return hooks + _m1_hooks(name, module, specs, group, tag)
    if style == "gated_deltanet":  # the norm's one weight over head_v_dim, used by this rank's heads: partial grads
        return hooks + install_grad_allreduce(getattr(module, deltanet.norm_name(module)), group, f"{tag}/norm")
    if style == "kimi_delta":  # the low-rank gates' first halves and the norm: used by every head, partial grads
        return hooks + [h for whole in kda.WHOLE for h in install_grad_allreduce(
            module.get_submodule(whole), group, f"{tag}/{whole}")]
    if groups is None:  # short_conv: nothing stays whole inside
        return hooks
    if groups % tp == 0:
        return hooks
    # fewer groups than ranks: B / C rows replicated (gradients summed over their holders), the norm's statistics
    # summed over the ranks sharing a group, and no fused kernel (it normalizes inside)
    norm = getattr(module, "norm", None)
    kind = norm_kind(norm)
    if kind not in ("none", None):
        norm._tp_norm = (group, rank * groups // tp, groups, f"{tag}/norm")
        norm.forward = bound_norm_forward(kind, norm)
    replicated = {p: spec for p, spec in specs.items() if spec.replicated_parts}
    return hooks + [module.register_forward_pre_hook(_replicas_enter(replicated, rank, group, f"{tag}/replicas")),
                    module.register_forward_hook(_replicas_leave, always_call=True)]


def bound_norm_forward(kind: str, norm: nn.Module):
    """The forward of a gated norm (:func:`norm_kind` ``kind``) whose group spans ranks, bound to ``norm`` (which
    holds ``_tp_norm`` = (group, slot, slots, tag) and ``_tp_full_group``)."""
    return types.MethodType(_group_size_norm if kind == "group_size" else _falcon_h1_norm, norm)


def _replicas_enter(specs: Dict[str, ShardSpec], rank: int, group, tag: str):
    def hook(module, args):
        saved = {}
        for pname, spec in specs.items():
            owner_name, _, leaf = pname.rpartition(".")
            owner = module.get_submodule(owner_name)
            param = owner._parameters[leaf]
            saved[pname] = param
            owner._parameters[leaf] = replica_grad_sum(param, spec, rank, group, tag)
        module.__dict__["_tp_replicas_saved"] = (saved, module.training)
        module.training = False  # the unfused path (see the module docstring); restored on the way out

    return hook


def _replicas_leave(module, args, output):
    saved, training = module.__dict__.pop("_tp_replicas_saved", ({}, module.training))
    for pname, param in saved.items():
        owner_name, _, leaf = pname.rpartition(".")
        module.get_submodule(owner_name)._parameters[leaf] = param
    module.training = training


class _SumOverSharers(torch.autograd.Function):
    """Forward and backward: ``x`` summed over the tp ranks that share this rank's group (``slots`` groups; the
    ranks holding slot ``slot``). One all-reduce over tp of a buffer with a row per group, this rank's at its slot
    (the kv-replica trick); over the whole tp group when there is one group. The backward sums too: each rank's
    gradient reaches only its own channels' use of the statistic."""

    @staticmethod
    def forward(ctx, x, group, slot, slots, tag):
        ctx.args = (group, slot, slots, tag)
        return _sum_over_sharers(x, group, slot, slots, tag)

    @staticmethod
    def backward(ctx, grad):
        return _sum_over_sharers(grad, *ctx.args), None, None, None, None


def _sum_over_sharers(x, group, slot, slots, tag):
    if slots == 1:
        return _reduce(x, group, tag)
    buf = x.new_zeros((slots,) + tuple(x.shape))
    buf[slot].copy_(x)
    return _reduce(buf, group, tag)[slot]


def _variance(norm, h: torch.Tensor) -> torch.Tensor:
    """The mean of ``h``'s squares over its whole group, whose channels span the ranks sharing it. ``norm._tp_norm``
    is one (group, slot, slots, tag) or a list of them, summed over in turn (sp x tp: the sp ranks sharing the
    tp-local group, then the tp ranks sharing the group)."""
    stages = norm._tp_norm if isinstance(norm._tp_norm, list) else [norm._tp_norm]
    squares = h.pow(2).sum(-1, keepdim=True)
    for group, slot, slots, tag in stages:
        squares = _SumOverSharers.apply(squares, group, slot, slots, tag)
    return squares / norm._tp_full_group


def _group_size_norm(self, hidden_states, gate=None):
    """transformers' ``*RMSNormGated`` (``group_size`` form) over a group spanning ranks."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    if gate is not None:
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    hidden_states = hidden_states * torch.rsqrt(_variance(self, hidden_states) + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _falcon_h1_norm(self, hidden_states, gate=None):
    """Falcon-H1's gated RMSNorm (``n_groups``, ``norm_before_gate``) over a group spanning ranks."""
    input_dtype = hidden_states.dtype
    if not self.norm_before_gate and gate is not None:
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    hidden_states = hidden_states.to(torch.float32)
    hidden_states = self.weight * (hidden_states * torch.rsqrt(_variance(self, hidden_states) + self.variance_epsilon))
    if self.norm_before_gate and gate is not None:
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    return hidden_states.to(input_dtype)


def mixer_plan_entries(model: nn.Module, covered, tp: int):
    """(entries to add to a Hugging Face model's built-in plan, mixers left whole -> why): ``mamba2`` / ``mamba1`` for
    every Mamba mixer no entry covers (nor its projections) that tp can split."""
    from lightning_scale.tensor_parallel.plan import _generic

    add: Dict[str, str] = {}
    whole: Dict[str, str] = {}
    for name, module in model.named_modules():
        style = mixer_style(module) if name else None
        if style is None or covered(name):
            continue
        if any(covered(f"{name}.{c}") for c in ("in_proj", "out_proj", "conv1d", "x_proj", "dt_proj", "conv",
                                                   *deltanet.PROJECTIONS, "o_proj", "g_b_proj") if hasattr(module, c)):
            continue
        why = unsupported(module, tp)
        if why is not None:
            whole.setdefault(_generic(name), why)
            continue
        add[name] = style  # by name: a hybrid may hold attention under the same attribute (Nemotron-H's mixer)
    return add, whole


# ----------------------------------------------------------------------------------------------------- Mamba-1


def _m1_unsupported(module: nn.Module, tp: int, setting: str = "tp") -> Optional[str]:
    kind = type(module).__name__
    d = module.intermediate_size
    if d % tp:
        return f"{kind}: {setting}={tp} does not divide its {d} channels"
    conv = module.conv1d
    if module.in_proj.out_features != 2 * d or conv.in_channels != d or conv.groups != d:
        return f"{kind}: in_proj / conv1d are not the Mamba-1 layout [x | z] / depthwise over {d} channels"
    if (module.x_proj.in_features != d or module.dt_proj.out_features != d or module.out_proj.in_features != d
            or module.A_log.shape[0] != d or module.D.shape != (d,)):
        return f"{kind}: x_proj / dt_proj / A_log / D / out_proj are not over its {d} channels"
    own = [n for n, _ in module.named_parameters(recurse=False) if n not in ("A_log", "D")]
    if own:
        return f"{kind}: parameters of its own besides A_log / D ({', '.join(own)}): not a Mamba-1 layout known here"
    if module.x_proj.bias is not None:
        return f"{kind}: x_proj has a bias (its output is summed over {setting}: the bias would be added {tp} times)"
    return None


def _m1_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    d = module.intermediate_size
    specs = {"in_proj.weight": make_spec(0, 2 * d, tp, parts=(d, d), what=f"{name}.in_proj")}
    if module.in_proj.bias is not None:
        specs["in_proj.bias"] = make_spec(0, 2 * d, tp, parts=(d, d), what=f"{name}.in_proj.bias")
    specs["conv1d.weight"] = make_spec(0, d, tp, what=f"{name}.conv1d")
    if module.conv1d.bias is not None:
        specs["conv1d.bias"] = make_spec(0, d, tp, what=f"{name}.conv1d.bias")
    specs["x_proj.weight"] = make_spec(1, d, tp, what=f"{name}.x_proj")
    specs["dt_proj.weight"] = make_spec(0, d, tp, what=f"{name}.dt_proj")
    if module.dt_proj.bias is not None:
        specs["dt_proj.bias"] = make_spec(0, d, tp, what=f"{name}.dt_proj.bias")
    specs["A_log"] = make_spec(0, d, tp, what=f"{name}.A_log")
    specs["D"] = make_spec(0, d, tp, what=f"{name}.D")
    specs["out_proj.weight"] = make_spec(1, d, tp, what=f"{name}.out_proj")
    return specs


@torch.no_grad()
def _localize_params(module: nn.Module, specs: Dict[str, ShardSpec], tp: int, rank: int) -> None:
    for pname, spec in specs.items():
        owner_name, _, leaf = pname.rpartition(".")
        keep_local(module.get_submodule(owner_name) if owner_name else module, leaf, spec, rank)
    set_counts(module, local_counts(module, specs, tp))


def _m1_hooks(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group, tag: str) -> List[object]:
    """A split Mamba-1 mixer's hooks besides the region's: x_proj's output summed over tp, the gradients of what
    stays whole summed."""
    hooks = [module.x_proj.register_forward_hook(summed_output_hook(group, f"{tag}/x_proj"))]
    for sub_name, sub in module.named_modules():  # what stays whole (Jamba's dt / B / C norms): gradients summed
        top = sub_name.split(".")[0]
        if sub_name and top not in _M1_SPLIT and any(True for _ in sub.parameters(recurse=False)):
            hooks.extend(install_grad_allreduce(sub, group, f"{tag}/{sub_name}"))
    return hooks


def summed_output_hook(group, tag: str):
    def hook(module, args, output):  # a partial sum over this rank's channels -> the whole; gradient summed too
        return _SumOverSharers.apply(output, group, 0, 1, tag)

    return hook
