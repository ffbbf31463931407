"""Sequence parallelism through Mamba mixers and gated DeltaNet layers (hybrid models under ``sp``).

Ulysses swaps the sequence split for a head split around attention (all-to-all in, all-to-all out). A Mamba mixer
carries a state along the whole sequence, so a rank cannot run it on its chunk; but its heads (Mamba-2) or channels
(Mamba-1) are independent along the sequence, exactly as tensor parallelism splits them
(:mod:`lightning_scale.tensor_parallel.mamba`). Under ``sp`` each mixer therefore runs the tp split over the sp
group, on the whole sequence:

* its input, this rank's chunk ``(B, L / sp, hidden)``, is all-gathered along the sequence (the backward
  reduce-scatters the input's gradient: every rank's heads contribute to every position);
* it runs on its ``1 / sp`` of the heads / channels with the whole mixer's weights read as this rank's slices (the
  tp layout: B / C of the rank's group, replicated pieces where there are fewer groups than ranks; the gated norm's
  statistics summed over the ranks sharing a group; Mamba-1's ``x_proj`` output summed over the group), the counts
  it reads made local for the call only;
* its output, a partial sum over the ranks' heads, is reduce-scattered back to this rank's chunk (the backward
  all-gathers the output's gradient). An ``out_proj`` bias is added by sp rank 0 only (the other ranks add
  ``bias * 0``: the engines average gradients over sp, so only one rank may hold the bias's gradient).

The parameters stay whole and replicated over sp, as every parameter is under Ulysses: each rank's gradient reaches
only its slice (and, for shared B / C rows or Jamba's dt / B / C norms, its part of it), and the data-parallel
reduction over sp, which sums the ranks' contributions for every parameter, completes them. ZeRO, checkpoints and
the optimizer see the unchanged model. Traffic per mixer and step: one all-gather and one reduce-scatter of the
hidden states (forward), the same pair backward: Megatron's sequence-parallel pattern around a tp region.

Gated DeltaNet layers (Qwen3-Next, Qwen 3.5: linear attention with a delta-rule state per head) run the same way,
cut by key-head groups (:mod:`lightning_scale.tensor_parallel.deltanet`), and LFM2's short gated convolutions by
channels (:mod:`lightning_scale.tensor_parallel.short_conv`).

The padding mask a mixer reads is the whole sequence's (:mod:`~lightning_scale.sequence_parallel.models` builds
every layer type's mask over the whole sequence), which is what the gathered input needs.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError
from lightning_scale.tensor_parallel import mamba as tpm
from lightning_scale.tensor_parallel.mappings import gather_from_sequence_region, reduce_scatter_to_sequence_region
from lightning_scale.tensor_parallel.sharding import ShardSpec


def mixer_kind(module: nn.Module) -> Optional[str]:
    """``mamba2`` / ``mamba1`` / ``gated_deltanet`` / ``short_conv`` (:func:`lightning_scale.tensor_parallel.mamba.
    mixer_style`): a recurrent layer sp runs cut by heads / channels; None for anything else."""
    return tpm.mixer_style(module)


def recurrent_left(model: nn.Module, layer_types: Sequence[str], recurrent: frozenset) -> Optional[str]:
    """The first recurrent layer type (``config.layer_types``) of ``model`` whose decoder layer holds no Mamba mixer
    nor any other layer :func:`mixer_kind` knows, None when every recurrent layer holds one."""
    from lightning_scale.models.hf_pipeline import hf_base_model

    layers = getattr(hf_base_model(model), "layers", None)
    wanted = [t for t in layer_types if t in recurrent]
    if not wanted:
        return None
    if layers is None or len(layers) != len(layer_types):
        return wanted[0]
    for kind, layer in zip(layer_types, layers):
        if kind in recurrent and not any(mixer_kind(m) for m in layer.modules()):
            return kind
    return None


def split_mixers(model: nn.Module, group) -> int:
    """Run every Mamba mixer of ``model`` over the sp ``group`` (see the module docstring); returns how many.
    ConfigError, before anything changes, naming ``sp`` and the mixer when one cannot be split."""
    sp = C.group_size(group)
    mixers = [(n, m) for n, m in model.named_modules() if mixer_kind(m)]
    for name, module in mixers:
        why = tpm.unsupported(module, sp, setting="sp")
        if why is not None:
            split = getattr(module, "_tp_mamba_specs", None) is not None  # its counts are one tp rank's already
            raise ConfigError(f"sp={sp}{' with tp > 1' if split else ''}: {name!r}: {why}"
                              f"{' (what one tp rank holds of it)' if split else ''} (sequence parallelism splits a "
                              f"recurrent layer's heads / channels over the sp ranks); use "
                              f"{'a smaller sp or tp' if split else 'tp, pp or ZeRO-3'} for it",
                              settings=("sp", "tp") if split else ("sp",))
    for name, module in mixers:
        _over_sequence(name, module, group)
    return len(mixers)


def _slice(param: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    """This rank's rows of ``param`` under ``spec``, as a differentiable view / concatenation of ``param``."""
    pieces = [param.narrow(spec.dim, start, n) for _, start, n in spec.pieces(rank)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def _over_sequence(name: str, module: nn.Module, group) -> None:
    sp, rank = C.group_size(group), C.group_rank(group)
    kind = mixer_kind(module)
    specs = tpm.mixer_specs(name, module, sp)  # a DeltaNet's norm weight stays whole: its partial gradients are summed
    counts = tpm.local_counts(module, specs, sp)  # over sp like every weight's
    norm = getattr(module, "norm", None)
    if norm is not None and isinstance(norm.__dict__.get("_tp_full_group"), int):  # tp split a group over its ranks:
        counts.pop(("norm", "_tp_full_group"), None)  # the whole group's width is set already (not this rank's)
    tag = f"sp/{name}"
    proj = specs.get("in_proj.weight")  # a buffer as wide as in_proj's output (Falcon-H1's mup_vector) is cut with it
    buffers = {} if proj is None else {
        b: ShardSpec(dim=buf.dim() - 1, size=proj.size, tp=proj.tp, padded=proj.padded, sections=proj.sections,
                     parts=proj.parts, splits=proj.splits)
        for b, buf in module._buffers.items() if buf is not None and buf.dim() >= 1 and buf.shape[-1] == proj.size}
    out = tpm.out_name(module, kind)
    state = dict(specs=specs, counts=counts, rank=rank, group=group, tag=tag, shared_group=False, buffers=buffers,
                 out=out)
    if kind == "mamba1":
        module.x_proj.register_forward_hook(tpm.summed_output_hook(group, f"{tag}/x_proj"))
    elif kind == "mamba2" and module.n_groups % sp:  # a group over several ranks: its norm's statistics summed
        state["shared_group"] = True
        norm_kind = tpm.norm_kind(norm)
        if norm_kind not in ("none", None):  # summed over the sp ranks sharing the group; then, where tp split the
            prior = norm.__dict__.get("_tp_norm")  # group over its ranks too, over those
            prior = [] if prior is None else prior if isinstance(prior, list) else [prior]
            norm._tp_norm = [(group, rank * module.n_groups // sp, module.n_groups, f"{tag}/norm")] + prior
            norm.forward = tpm.bound_norm_forward(norm_kind, norm)
    module._sp_mamba = state
    # after a tp split's hooks on the way in (its copy into the region sees this rank's chunk), before them on the way
    # out (the output reduce-scattered over sp first: tp's all-reduce then sums the chunk, and its parameter swaps are
    # undone after this one's)
    module.register_forward_pre_hook(functools.partial(_enter, state), with_kwargs=True)
    module.register_forward_hook(functools.partial(_leave, state), always_call=True, prepend=True)


def _enter(state: Dict, module: nn.Module, args, kwargs):
    group, rank, tag = state["group"], state["rank"], state["tag"]
    saved_params = {}
    for pname, spec in state["specs"].items():
        owner_name, _, leaf = pname.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        param = owner._parameters[leaf]
        saved_params[pname] = param
        owner._parameters[leaf] = _slice(param, spec, rank)
    out = state["out"]  # out_proj (OLMo hybrid's gated DeltaNet: o_proj)
    bias = module.get_submodule(out)._parameters.get("bias")
    if bias is not None and rank > 0:  # the output is summed over sp: rank 0 adds the bias and gets its gradient,
        saved_params.setdefault(f"{out}.bias", bias)  # which the average over sp then counts once; here zero
        module.get_submodule(out)._parameters["bias"] = bias * 0  # (a zero gradient, not none: ZeRO's hooks fire)
    saved_buffers = {}
    for bname, spec in state["buffers"].items():  # specs found once (_over_sequence), not per call
        saved_buffers[bname] = module._buffers[bname]
        module._buffers[bname] = _slice(saved_buffers[bname], spec, rank)
    saved_counts = tpm.set_counts(module, state["counts"])
    module.__dict__["_sp_saved"] = (saved_params, saved_buffers, saved_counts, module.training)
    if state["shared_group"]:
        module.training = False  # the unfused path: the fused kernel normalizes inside (tensor_parallel/mamba.py)
    if args:
        args = (gather_from_sequence_region(args[0], group, dim=1, tag=tag),) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, hidden_states=gather_from_sequence_region(kwargs["hidden_states"], group, dim=1,
                                                                        tag=tag))
    return args, kwargs


def _leave(state: Dict, module: nn.Module, args, output):
    saved = module.__dict__.pop("_sp_saved", None)
    if saved is not None:
        saved_params, saved_buffers, saved_counts, training = saved
        for pname, param in saved_params.items():
            owner_name, _, leaf = pname.rpartition(".")
            (module.get_submodule(owner_name) if owner_name else module)._parameters[leaf] = param
        module._buffers.update(saved_buffers)
        for (owner, attr), value in saved_counts.items():
            sub = module.get_submodule(owner) if owner else module
            if value is None:
                sub.__dict__.pop(attr, None)
            else:
                setattr(sub, attr, value)
        module.training = training
    if not isinstance(output, torch.Tensor):
        return output  # an exception on the way (always_call): nothing to scatter
    return reduce_scatter_to_sequence_region(output, state["group"], dim=1, tag=state["tag"])
