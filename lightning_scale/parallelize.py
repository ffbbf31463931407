"""The one composition order: ``parallelize(module, config, topology, device) -> ParallelModel``. Torch only.

The Trainer strategy, the Fabric strategy and plain ``torch.distributed`` scripts all call this; none re-implements
the order. Each step is a small ``apply_*`` function on an unchanged model (torchtitan's ``parallelize.py`` shape):

1. **rank 0's weights** (a model built for real): moved to the device and broadcast, so every rank splits the same
   values (a model on ``meta`` skips this: it is initialized piece by piece below).
2. :func:`apply_tp` — the tensor-parallel plan splits the module over the tp group (each rank keeps its slices;
   on ``meta`` nothing is allocated); ``tensor.overlap_chunks > 1`` then overlaps each row-parallel layer's forward
   all-reduce with its own matmul, chunk by chunk (:mod:`lightning_scale.tensor_parallel.overlap`).
3. :func:`apply_pipeline` — the pipeline stage is cut from the (split) layers; on ``meta`` only this stage is
   allocated and initialized; the other stages' parameters are frozen and freed.
4. :func:`apply_sp` — Ulysses sequence parallelism (``sp > 1``): each attention runs between two all-to-alls over
   the sp group, positions and the loss see the whole sequence (:mod:`lightning_scale.sequence_parallel`; instances
   changed, the module tree is not). ZeRO (steps 7 and the engines) then shards over dp x sp.
   :func:`apply_ac` — activation checkpointing (``activation_checkpointing="full" | "selective"``) wraps each unit's
   forward (:mod:`lightning_scale.activation_checkpointing`; the module tree is unchanged); with ``tiled_mlp=N``
   each unit's MLP runs and recomputes N positions at a time (:mod:`lightning_scale.tiled_mlp`), with
   ``tiled_attention=H`` its attention H heads at a time (:mod:`lightning_scale.tiled_attention`).
5. :func:`materialize_local` (ZeRO stages 0-2) — a ``meta`` tp model gets only its slices allocated, initialized
   as slices of the full dense layers; dp replicas take dp rank 0's values.
6. the optimizers: built now over the local parameters (a callable, e.g. Lightning's ``configure_optimizers``),
   or given ones remapped by parameter name onto the local parameters (Fabric, plain scripts).
7. :func:`apply_zero3` (ZeRO stage 3) — the module's units are materialized, initialized and cut to their dp
   shards one at a time (``ShardedParameters``); the optimizers' param groups decide the flat buckets.
8. :func:`apply_compile` (``compile=True`` or torch.compile options) — each unit's forward is compiled
   (:mod:`lightning_scale.compile`): the ZeRO-3 hooks, the activation checkpoint and every collective stay eager at
   the unit boundaries (collectives are deliberate graph breaks); identical blocks share one compiled graph.

Pretrained weights recorded on a ``meta`` model (:mod:`lightning_scale.pretrained`: ``from_pretrained`` inside
``configure_model``) are checked first (directory, architecture, every tensor's shape) and then *read* wherever
steps 3, 5 and 7 would initialize: each rank reads its stage, its tp slices, its dp shard of each ZeRO-3 bucket.

The returned :class:`ParallelModel` holds what the front doors need: the local module, the tp-split submodule,
the pipeline placement (stage, runtime, schedule), the ``ShardedParameters``, the optimizers, and
:meth:`ParallelModel.make_engines` (one :mod:`lightning_scale.zero.engine` engine per optimizer, with the
:class:`~lightning_scale.zero.model_parallel.CrossAxis` the tp / pp axes agree on).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError, ParallelConfig
from lightning_scale.materialize import has_meta, materialize_
from lightning_scale.topology import Topology
from lightning_scale.zero.engine import ZeroEngine, check_engine_supported, make_engine
from lightning_scale.zero.model_parallel import CrossAxis

Optimizers = Union[None, Sequence[torch.optim.Optimizer], Callable[[], Sequence[torch.optim.Optimizer]]]


@dataclass
class ParallelModel:
    """What :func:`parallelize` built on this rank."""

    module: nn.Module
    config: ParallelConfig
    topology: Topology
    device: torch.device
    tp_name: str = ""  # the split submodule's name inside ``module`` ("" = the module itself)
    tp_model: Optional[nn.Module] = None
    tp_summary: Optional[Dict[str, Any]] = None  # tensor_parallel.state.split_summary: what tp split / replicated
    pipeline: Any = None  # lightning_scale.pipeline.placement.PipelinePlacement at pp > 1
    sharded: Any = None  # lightning_scale.zero.param_shard.ShardedParameters at zero.stage=3
    optimizers: List[torch.optim.Optimizer] = field(default_factory=list)
    routed: List[str] = field(default_factory=list)  # dense MoE layers made routed (tensor_parallel/routed_experts.py)

    @property
    def model_parallel(self) -> bool:
        return self.config.tp_axis > 1 or self.config.pp > 1

    # ------------------------------------------------------------------ engines
    def cross_axis(self) -> Optional[CrossAxis]:
        """The tp / pp agreement for this rank's engines; None at tp == pp == 1 (plain data parallel)."""
        if not self.model_parallel:
            return None
        return cross_axis_for(self.tp_model, self.topology.tp_group, self.topology.pp_group,
                              exclude=self.pipeline.norm_exclude if self.pipeline is not None else (),
                              grad_scale=1.0 / self.config.ep, grad_group=getattr(self.topology, "tp_grad_group", None))

    def make_engines(self, *, precision=None, loss_scaler=None, overlap_comm: Optional[bool] = None
                     ) -> List[ZeroEngine]:
        """One engine per optimizer (:func:`lightning_scale.zero.engine.make_engine`), in order."""
        cross, engines, offset = self.cross_axis(), [], 0
        for opt in self.optimizers:
            engines.append(make_engine(opt, self.config, self.topology, self.sharded, group=self.topology.dp_sp_group,
                                       precision=precision,
                                       loss_scaler=loss_scaler, cross_axis=cross, group_offset=offset,
                                       overlap_comm=overlap_comm))
            offset += len(opt.param_groups)
        return engines

    # ------------------------------------------------------------------ whole-model state (collectives)
    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """ZeRO 0-2 under tp / pp: ``module.state_dict()`` with the original keys and shapes (collective)."""
        with self.whole_model():
            if self.tp_model is not None:
                return tp_full_state_dict(self.module, self.tp_name, self.tp_model)
            return self.module.state_dict()

    @torch.no_grad()
    def consolidate_tp(self, local: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """A state_dict of this rank's tp slices (module keys) -> the original keys and shapes (collective over tp)."""
        full = tp_full_state_dict(self.module, self.tp_name, self.tp_model, values=local)
        order = list(self.module.state_dict(keep_vars=True))  # the module's key order (no tensor is read)
        return {k: full[k] for k in order if k in full} | {k: v for k, v in full.items() if k not in order}

    @torch.no_grad()
    def consolidate_stage3(self, local: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """ZeRO-3: this rank's dp-gathered state (its tp slices of its pipeline stage) -> the whole model, with the
        original keys and shapes, on every rank. Collective over tp and pp."""
        if self.tp_model is not None:
            local = self.consolidate_tp(local)
        if self.pipeline is None:
            return local
        parts: List[Optional[Dict[str, torch.Tensor]]] = [None] * self.topology.pp
        dist.all_gather_object(parts, {k: v for k, v in local.items() if v.numel() > 0}, group=self.topology.pp_group)
        full: Dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                full.setdefault(k, v)
        order = list(self.module.state_dict(keep_vars=True))
        return {k: full[k] for k in order if k in full}

    @torch.no_grad()
    def load_full_state_dict(self, full: Dict[str, torch.Tensor], strict: bool = True) -> None:
        """A consolidated state_dict (original keys and shapes) into the split module (collective over pp): each
        rank keeps its tp slices and its own stage's tensors."""
        if self.tp_model is not None:
            full = tp_shard_full_state_dict(full, self.tp_name, self.tp_model)
        with self.whole_model():
            self.module.load_state_dict(full, strict=strict)

    def whole_model(self):
        """Under pp: every stage's tensors on every rank while inside (collective); else nothing to do."""
        return self.pipeline.materialized(self.module) if self.pipeline is not None else contextlib.nullcontext()


def cross_axis_for(tp_model: Optional[nn.Module], tp_group=None, pp_group=None, exclude=(),
                   grad_scale: float = 1.0, grad_group=None) -> CrossAxis:
    """The :class:`CrossAxis` of engines over a tp-split ``tp_model`` (None: no tp) and a pipeline (``pp_group``;
    ``exclude``: tied copies another stage counts): the tensor-parallel package's marks as predicates."""
    from lightning_scale.tensor_parallel import sync_tp_grads, tp_replicated
    from lightning_scale.tensor_parallel.sharding import tp_counted_mask, tp_partial_grad
    from lightning_scale.tensor_parallel.state import tensor_parallel_state

    if tp_model is not None:
        state = tensor_parallel_state(tp_model)
        if state is not None:
            state.partial_grad_params(tp_model)  # (re)marks them on the current parameter objects
    return CrossAxis(tp_group=tp_group, pp_group=pp_group, replicated=tp_replicated, partial=tp_partial_grad,
                     exclude=exclude, before_reduce=(lambda: sync_tp_grads(tp_model)) if tp_model is not None else None,
                     counted=tp_counted_mask, grad_scale=grad_scale, grad_group=grad_group)


# ---------------------------------------------------------------------------------------------------- checks
def check_config(config: ParallelConfig) -> None:
    """What the composition cannot run yet, rejected on every rank before any model is touched."""
    config.tensor.validate(config.tp)  # a ParallelConfig built by hand may skip validate()
    if config.compile:
        from lightning_scale.compile import compile_options

        compile_options(config.compile)  # the backend exists
    if config.pp > 1 and config.tp > 1 and config.zero.stage == 3:
        raise ConfigError(f"zero.stage=3 with pp={config.pp} and tp={config.tp}: ZeRO-3 composes with tp or with "
                          "pp, not with both yet; use zero.stage 1 or 2 for 3D")
    if config.sp > 1 and config.tp > 1 and config.tensor.sequence_parallel:
        raise ConfigError(f"sp={config.sp} with tensor.sequence_parallel=True: Ulysses already splits the sequence "
                          "over sp; tp's own sequence split on top of it is not supported (docs/long_sequences.md)",
                          settings=("sp", "tensor.sequence_parallel"))
    if config.pp > 1 and config.zero.stage == 3 and config.pipeline.schedule == "zero_bubble":
        raise ConfigError("zero.stage=3 with pipeline.schedule='zero_bubble': ZeRO-3 reduce-scatters each unit's "
                          "gradient when its backward ends, which the deferred weight gradients of the zero-bubble "
                          "schedule bypass; use '1f1b', 'gpipe' or 'interleaved_1f1b'")


def check_all_trainable_owned(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    owned = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owned]
    if missing:
        raise ConfigError(f"trainable parameter(s) {missing[:5]} are in no optimizer param group returned by "
                          "configure_optimizers; add them or set requires_grad=False")


# ---------------------------------------------------------------------------------------------------- steps
@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, group=None) -> None:
    """Every rank starts from rank 0's parameters and buffers (seeds can differ per rank)."""
    if dist.is_available() and dist.is_initialized() and C.group_size(group) > 1:
        src = 0 if group is None else dist.get_global_rank(group, 0)
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def apply_tp(pm: ParallelModel) -> None:
    """Split the module over the tp group with its plan (``tensor.plan`` or the model's built-in one); with ``ep > 1``
    place every experts module's experts on the ep ranks the tp axis carries (:func:`apply_ep`)."""
    if pm.config.ep > 1:
        return apply_ep(pm)
    if pm.config.tp <= 1:
        return
    import lightning_scale.models  # noqa: F401  (registers the model adapters: litgpt, Hugging Face)
    from lightning_scale.tensor_parallel import apply_tensor_parallel, find_plannable_module

    plan = pm.config.tensor.plan
    try:
        pm.tp_name, pm.tp_model = find_plannable_module(pm.module)
    except ConfigError:
        if plan is None:
            raise
        pm.tp_name, pm.tp_model = "", pm.module
    apply_tensor_parallel(pm.tp_model, plan, pm.topology.tp_group, sequence_parallel=pm.config.tensor.sequence_parallel,
                          expert_parallel=pm.config.tensor.expert_parallel)
    from lightning_scale.tensor_parallel.state import split_summary

    pm.tp_summary = split_summary(pm.tp_model, pm.config.tp)
    if pm.config.tensor.overlap_chunks > 1:  # row-parallel forward all-reduce overlapped chunk by chunk (overlap.py)
        from lightning_scale.tensor_parallel.overlap import set_overlap

        set_overlap(pm.tp_model, pm.config.tensor.overlap_chunks)


def apply_ep(pm: ParallelModel) -> None:
    """Expert parallelism over data-parallel ranks: every transformers experts module's experts placed whole on the ep
    ranks, routes exchanged by all-to-all (:mod:`lightning_scale.tensor_parallel.expert_alltoall`); every other
    parameter stays whole, its gradient summed over ep."""
    from lightning_scale.tensor_parallel import apply_tensor_parallel
    from lightning_scale.tensor_parallel.expert_alltoall import expert_data_parallel_plan
    from lightning_scale.tensor_parallel.state import split_summary

    if pm.config.tensor.plan is not None:
        raise ConfigError(f"tensor.plan with ep={pm.config.ep}: the ep layout places every experts module and keeps "
                          "the rest whole; a tensor-parallel plan has nothing to split (tp=1)",
                          settings=("tensor.plan", "ep"))
    pm.tp_name, pm.tp_model = "", pm.module
    apply_tensor_parallel(pm.module, expert_data_parallel_plan(pm.module, pm.config.ep), pm.topology.tp_group)
    pm.tp_summary = split_summary(pm.module, pm.config.ep)


def apply_pipeline(pm: ParallelModel, loss_fn: Optional[Callable] = None, timeout=None) -> None:
    """Cut this rank's pipeline stage (and, on ``meta``, allocate only it)."""
    if pm.config.pp <= 1:
        return
    import lightning_scale.models  # noqa: F401  (registers the model adapters' layer providers)
    from lightning_scale.pipeline.placement import PipelinePlacement

    pm.pipeline = PipelinePlacement(pm.module, pm.config, pm.topology, loss_fn=loss_fn, timeout=timeout,
                                    device=pm.device)
    if pm.config.zero.stage == 3 and pm.pipeline.stage.tied:
        raise ConfigError(f"zero.stage=3 with pp={pm.config.pp}: parameter(s) "
                          f"{[t.name for t in pm.pipeline.stage.tied][:3]} are shared by two pipeline stages (a tied "
                          "embedding / head); untie them or use zero.stage 1 or 2")


def apply_sp(pm: ParallelModel) -> None:
    """Ulysses sequence parallelism over the sp group (a ConfigError naming ``sp`` for a model it cannot swap)."""
    if pm.config.sp <= 1:
        return
    from lightning_scale.sequence_parallel import apply_sequence_parallel

    tp_group = pm.topology.tp_group if pm.config.tp > 1 else None  # heads / tp per rank already: split them over sp
    apply_sequence_parallel(pm.module, pm.topology.sp_group, tp_group=tp_group,
                            stage=pm.pipeline.stage if pm.pipeline is not None else None)
    if pm.pipeline is not None:  # every stage's attention runs over its sp group; the last stage's loss spans it
        from lightning_scale.sequence_parallel.models import sequence_parallel_loss

        runtime = pm.pipeline.runtime
        if hasattr(runtime.loss_fn, "sp_group"):  # the Trainer's PipelineLoss: it takes the whole-sequence mean
            runtime.loss_fn.sp_group = pm.topology.sp_group
        else:
            runtime.loss_fn = sequence_parallel_loss(runtime.loss_fn, pm.topology.sp_group)


def apply_ac(pm: ParallelModel) -> None:
    """Activation checkpointing on every unit of the (split, cut) module; before ZeRO-3 registers its unit hooks."""
    from lightning_scale.activation_checkpointing import checkpoint_units

    checkpoint_units(pm.module, pm.config.activation_checkpointing, pm.config.activation_checkpointing_units,
                     offload=pm.config.offload_activations)
    if pm.config.tiled_mlp:  # inside the units: their MLPs run tile by tile (lightning_scale.tiled_mlp)
        from lightning_scale.tiled_mlp import tile_mlps

        tile_mlps(pm.module, pm.config.tiled_mlp, pm.config.tiled_mlp_modules, compiled=bool(pm.config.compile))
    if pm.config.tiled_attention:  # and their attention a group of heads at a time (lightning_scale.tiled_attention)
        from lightning_scale.tiled_attention import tile_attention

        tile_attention(pm.module, pm.config.tiled_attention, compiled=bool(pm.config.compile))


@torch.no_grad()
def apply_compile(pm: ParallelModel, user_compile: Optional[Callable] = None) -> None:
    """torch.compile per unit, last: after the ZeRO-3 hooks and the activation checkpoint that stay around it.
    ``user_compile``: the Dynamo context of a ``torch.compile`` the user applied to a submodule (used when the
    ``compile`` option is off)."""
    if not pm.config.compile and user_compile is None:
        return
    from lightning_scale.compile import compile_units

    compile_units(pm.module, pm.config.compile, pm.config.zero.unit_modules, compiler=user_compile)


def materialize_local(pm: ParallelModel) -> None:
    """ZeRO 0-2: a module still on ``meta`` (tp without pp) allocates only its slices; then it is on the device."""
    if has_meta(pm.module, recurse=True):
        from lightning_scale.pretrained import weight_sources

        if pm.tp_model is None and not weight_sources(pm.module):  # pretrained: every dp replica reads it whole
            raise ConfigError("the module is on the meta device, but only zero.stage=3, tp > 1 or pp > 1 "
                              "materialize it piece by piece; build it for real or pick one of those layouts")
        materialize_(pm.module, pm.device, lambda name, m: True)
        dp = pm.topology.dp_sp_group  # every dp and sp replica holds the same values
        if C.group_size(dp) > 1:
            src = dist.get_global_rank(dp, 0)
            for t in list(pm.module.parameters()) + list(pm.module.buffers()):
                C.broadcast(t.data, src=src, group=dp, tag="init")
    pm.module.to(pm.device)


def apply_zero3(pm: ParallelModel, groups: List[List[nn.Parameter]], param_dtype: Optional[torch.dtype] = None) -> None:
    """Shard the module's units over dp (materializing a ``meta`` module unit by unit)."""
    from lightning_scale.zero.param_shard import ShardedParameters

    cfg = pm.config
    sharded = ShardedParameters(
        pm.module, groups, group=pm.topology.dp_sp_group, device=pm.device, param_dtype=param_dtype,
        unit_modules=cfg.zero.unit_modules, prefetch_depth=cfg.zero.prefetch_depth,
        persistent_threshold=cfg.zero.persistent_threshold,
        param_device=torch.device("cpu") if cfg.offload.params != "none" else None, pin_memory=cfg.offload.pin_memory)
    sharded.shard_model()
    if param_dtype is not None:  # what the engine does not own: frozen params and floating buffers
        for t in list(sharded.frozen) + list(pm.module.buffers()):
            if t.is_floating_point():
                t.data = t.data.to(param_dtype)
    pm.sharded = sharded


def _resolve_optimizers(pm: ParallelModel, optimizers: Optimizers, names: Dict[int, str]
                        ) -> List[torch.optim.Optimizer]:
    """Build them now (a callable), or remap given ones onto the local parameters by the names they had."""
    if optimizers is None:
        return []
    if callable(optimizers):
        return list(optimizers())
    from lightning_scale.tensor_parallel.expert_lists import foreign_keys

    local = dict(pm.module.named_parameters(remove_duplicate=False))
    elsewhere = foreign_keys(pm.module, names.values())  # experts another rank holds (placed by ownership)
    for opt in optimizers:
        if opt.state:
            raise ConfigError(f"{type(opt).__name__} has already stepped: set the model up before training")
        for group in opt.param_groups:
            remapped = []
            for p in group["params"]:
                name = names.get(id(p))
                if name is None:
                    raise ConfigError(f"{type(opt).__name__} holds a parameter that is not in the module being set up")
                if name not in elsewhere:
                    remapped.append(local[name])
            group["params"] = remapped
    return list(optimizers)


def parallelize(module: nn.Module, config: ParallelConfig, topology: Topology, device: Union[str, torch.device], *,
                optimizers: Optimizers = None, loss_fn: Optional[Callable] = None, timeout=None,
                param_dtype: Optional[torch.dtype] = None) -> ParallelModel:
    """Apply the layout of ``config`` to ``module`` on this rank, in the one order (module docstring).

    ``optimizers``: a callable building them over the local parameters (called after the module steps, before
    ZeRO-3), or optimizers built over the original module (remapped by parameter name), or None (evaluation
    only: ZeRO-3 then shards every trainable parameter as one group). ``loss_fn(output, target)``: the last
    pipeline stage's micro-batch loss (pp > 1). ``param_dtype``: the compute dtype of a low-precision policy
    (ZeRO-3 shards in it). Collective: every rank of ``topology`` calls it with the same arguments.
    """
    check_config(config)
    from lightning_scale.pretrained import check_weight_sources

    check_weight_sources(module)  # pretrained weights recorded on meta: directory, architecture, every tensor
    from lightning_scale.compile import unwrap_compiled

    user_compile = unwrap_compiled(module)  # a user's torch.compile(submodule): compiled per unit at the end instead
    from lightning_scale.tensor_parallel.routed_experts import route_experts

    pm = ParallelModel(module, config, topology, torch.device(device))
    pm.routed = route_experts(module)  # Llama 4's dense experts routed (same math): they split, place and exchange
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    stage3 = config.zero.stage == 3
    if not has_meta(module, recurse=True) and (not stage3 or pm.model_parallel):
        module.to(pm.device)  # ZeRO-3 alone places its shards itself
        broadcast_from_rank0(module)
    apply_tp(pm)
    apply_pipeline(pm, loss_fn=loss_fn, timeout=timeout)
    apply_sp(pm)
    apply_ac(pm)
    if not stage3:
        materialize_local(pm)
    pm.optimizers = _resolve_optimizers(pm, optimizers, names)
    for opt in pm.optimizers:
        check_engine_supported(opt, config, model_parallel=pm.model_parallel)  # before anything is sharded
    if pm.optimizers:
        check_all_trainable_owned(module, pm.optimizers)
    if stage3:
        groups = [list(g["params"]) for opt in pm.optimizers for g in opt.param_groups] or \
            [[p for p in module.parameters() if p.requires_grad]]
        apply_zero3(pm, groups, param_dtype)
    apply_compile(pm, user_compile)
    return pm


# ---------------------------------------------------------------------------------------------------- tp state
@torch.no_grad()
def tp_full_state_dict(module: nn.Module, name: str, target: nn.Module,
                       values: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` with the split submodule's tensors gathered to the original keys and shapes.

    ``values``: this rank's local tensors to use instead of the module's own (module keys; ZeRO-3 passes its
    dp-gathered fp32 masters, since its parameters are freed between steps). Collective over the tp group.
    """
    from lightning_scale.tensor_parallel import consolidate_state_dict

    out = dict(values) if values is not None else module.state_dict()
    prefix = name + "." if name else ""
    sub = None if values is None else {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
    for key, value in consolidate_state_dict(target, values=sub).items():
        out[prefix + key] = value
    return out


def tp_shard_full_state_dict(full: Dict[str, torch.Tensor], name: str, target: nn.Module) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`tp_full_state_dict` on this rank: the split submodule's tensors sliced (no communication)."""
    from lightning_scale.tensor_parallel import shard_state_dict

    prefix = name + "." if name else ""
    sub = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
    out = dict(full)
    for key, value in shard_state_dict(target, sub).items():
        out[prefix + key] = value
    return out


def local_topology(config: ParallelConfig, world_size: int, rank: int) -> Topology:
    """The Topology for ``config`` on ``world_size`` ranks, groups built (a collective)."""
    config.validate(world_size)
    topo = Topology.of(config, world_size, rank)
    topo.build_groups()
    return topo


__all__ = ["ParallelModel", "parallelize", "cross_axis_for", "apply_tp", "apply_ep", "apply_pipeline", "apply_sp", "apply_ac",
           "materialize_local", "apply_zero3", "broadcast_from_rank0", "check_config", "local_topology",
           "tp_full_state_dict", "tp_shard_full_state_dict"]
