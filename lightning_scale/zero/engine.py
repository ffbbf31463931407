"""The ZeRO engine interface and the one factory that builds every engine.

An *engine* wraps one user optimizer for one rank: it owns how that optimizer's gradients are reduced over
the dp group, how the step runs on the rank's shard, and what is saved. Every engine implements
:class:`ZeroEngine`, and :func:`make_engine` is the only place that chooses one:

================================  =====================================================================
``ZeroOptimizer``                 stages 0, 1, 2 (and optimizer offload at 1, 2): flat buckets, reducer hooks
``Stage3Optimizer``               stage 3 (and offload): the unit shards of a ``ShardedParameters``
``OneBitZeroOptimizer``           ``OneBitAdam`` at stages 1, 2: 1-bit reduce-scatter onto the shards
``SelfReducingEngine``            ``OneBitAdam`` at stage 0: the optimizer communicates by itself
================================  =====================================================================

Tensor / pipeline parallelism is not a subclass: the engine is handed a
:class:`~lightning_scale.zero.model_parallel.CrossAxis` (what tp and pp agree on). The front doors (the
Trainer strategy, the Fabric strategy, a plain script) call :func:`make_engine` (usually through
:func:`lightning_scale.parallelize.ParallelModel.make_engines`) and drive engines only through this protocol.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from lightning_scale.config import ConfigError
from lightning_scale.optim.onebit_adam import OneBitAdam, check_zero_stage
from lightning_scale.zero.model_parallel import CrossAxis
from lightning_scale.zero.onebit import OneBitZeroOptimizer
from lightning_scale.zero.optimizer import ZeroOptimizer
from lightning_scale.zero.precision import NoLossScaler
from lightning_scale.zero.stage3_optimizer import Stage3Optimizer


@runtime_checkable
class ZeroEngine(Protocol):
    """What every engine does. ``optimizer`` is the user's object (its ``param_groups`` are what Lightning and
    lr schedulers see); ``stage`` the ZeRO stage; ``loss_scaler`` the fp16 scaler (or a no-op one)."""

    optimizer: torch.optim.Optimizer
    stage: int
    loss_scaler: Any

    def no_sync(self) -> ContextManager[None]:
        """Accumulate gradients with no communication (non-final micro-batches)."""

    def reduce_gradients(self) -> bool:
        """Finish the gradient reduction, unscale, agree on overflow over the grid; returns found_inf."""

    def mark_overflow(self) -> None:
        """Skip this step (another party saw an overflow) and back the loss scale off."""

    def global_grad_norm(self) -> torch.Tensor:
        """The whole model's gradient L2 norm (float64), equal on every rank."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm; returns the norm before clipping."""

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clip each gradient element."""

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The optimizer step on this rank's shard (skipped on overflow), then the parameters updated."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        ...

    def keep_gradients_once(self) -> None:
        """Ignore the next ``zero_grad`` (a pipeline schedule computed the gradients before Lightning zeroes)."""

    def state_dict(self) -> Dict[str, Any]:
        ...

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        ...

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds: params, grads, master, optimizer_state, total, device, host."""

    def remove_hooks(self) -> None:
        ...

    # The layout-free checkpoint (lightning_scale.checkpoint.engine_pieces; OneBit engines: .onebit_pieces).
    def named_pieces(self, names: Mapping[int, str], weights_from: Optional[str] = None) -> Iterator[Any]:
        """This rank's ``model/`` / ``master/`` / ``optim/`` pieces, views into live storage; ``weights_from``
        ("master" | "model") gives the load set (weights read into the masters from that key)."""

    def allocate_state_(self, states: Mapping[str, Any]) -> None:
        """Before a load: allocate the lazily created optimizer state (name -> (dtype, is 0-d))."""

    def after_load_(self, missing: Sequence[str], names: Mapping[int, str]) -> None:
        """After a load: parameters refreshed from the masters; a warning for missing optimizer state."""


class SelfReducingEngine:
    """An optimizer that reduces its own gradients (``OneBitAdam`` at stage 0): nothing is sharded, the
    optimizer exchanges its compressed momentum inside its own ``step``. Clipping clips the local gradients,
    as Lightning does for a plain optimizer."""

    stage = 0

    def __init__(self, optimizer: OneBitAdam, group) -> None:
        optimizer.bind_process_group(group)
        self.optimizer = optimizer
        self.loss_scaler = NoLossScaler()
        self._keep_grads_once = False

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def no_sync(self) -> ContextManager[None]:
        return contextlib.nullcontext()  # nothing is communicated before step anyway

    def reduce_gradients(self) -> bool:
        return False

    def mark_overflow(self) -> None:
        raise ConfigError("OneBitAdam at zero.stage=0 does not take part in an overflow vote (no fp16 loss "
                          "scaling or pipeline/tensor parallelism with it)")

    def global_grad_norm(self) -> torch.Tensor:
        return torch.nn.utils.get_total_norm([p.grad for p in self._params()]).double()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self._params(), max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(self._params(), clip_value)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._keep_grads_once:
            self._keep_grads_once = False
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def keep_gradients_once(self) -> None:
        self._keep_grads_once = True

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def memory_bytes(self) -> Dict[str, int]:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        p_bytes = sum(size(p) for p in params)
        g_bytes = sum(size(p.grad) for p in params if p.grad is not None)
        state = sum(size(v) for s in self.optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        total = p_bytes + g_bytes + state
        return {"params": p_bytes, "grads": g_bytes, "master": 0, "optimizer_state": state, "total": total,
                "device": total, "host": 0}

    def remove_hooks(self) -> None:
        pass

    # The layout-free checkpoint: lightning_scale.checkpoint.onebit_pieces (error-feedback buffers per rank).
    def named_pieces(self, names: Mapping[int, str], weights_from: Optional[str] = None) -> Iterator[Any]:
        from lightning_scale.checkpoint.onebit_pieces import self_reducing_pieces

        return self_reducing_pieces(self, names, weights_from)

    def allocate_state_(self, states: Mapping[str, Any]) -> None:
        """The state is allocated by ``named_pieces(weights_from=...)`` (OneBitAdam's own, per parameter)."""

    def after_load_(self, missing: Sequence[str], names: Mapping[int, str]) -> None:
        from lightning_scale.checkpoint.onebit_pieces import self_reducing_after_load

        self_reducing_after_load(self, missing)

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def check_engine_supported(optimizer: torch.optim.Optimizer, config, *, model_parallel: bool = False) -> None:
    """The ConfigError :func:`make_engine` would raise for this optimizer, raised before anything is built."""
    if isinstance(optimizer, OneBitAdam):
        check_zero_stage(config.zero.stage)  # ConfigError at stage 3, naming it
        if model_parallel:
            raise ConfigError(f"{type(optimizer).__name__} reduces its own gradients over dp only; with tp="
                              f"{config.tp}, pp={config.pp} use an optimizer the ZeRO engine wraps (e.g. AdamW)")


def make_engine(optimizer: torch.optim.Optimizer, config, topology=None, sharded=None, *, group=None,
                precision=None, loss_scaler=None, cross_axis: Optional[CrossAxis] = None, group_offset: int = 0,
                overlap_comm: Optional[bool] = None) -> ZeroEngine:
    """The engine for ``optimizer`` under ``config`` (a :class:`~lightning_scale.config.ParallelConfig`).

    ``group``: the dp group (default ``topology.dp_group``). ``sharded``: the ``ShardedParameters`` at stage 3
    (``parallelize`` builds it), with ``group_offset`` = where this optimizer's param groups start in the
    group list it was built from. ``cross_axis``: the tp / pp agreement (default: none). ``overlap_comm``
    overrides ``config.zero.overlap_comm`` (the front door turns it off where hooks must not reduce early); by default
    it is off where whole parameters get partial gradients (sequence parallel, ep > 1: ``config.partial_grads``) and
    no twin tp group sums them inside the backward (``cross_axis.grad_group``).
    """
    stage = config.zero.stage
    if group is None and topology is not None:
        group = topology.dp_group
    offload = config.offload.optimizer != "none"
    check_engine_supported(optimizer, config, model_parallel=cross_axis is not None and bool(cross_axis.groups))
    if isinstance(optimizer, OneBitAdam):
        if stage == 0:
            return SelfReducingEngine(optimizer, group)
        return OneBitZeroOptimizer(optimizer, stage=stage, group=group, precision=precision, loss_scaler=loss_scaler,
                                   bucket_mb=config.zero.bucket_mb)
    if stage == 3:
        if sharded is None:
            raise ValueError("zero.stage=3: make_engine needs the ShardedParameters that parallelize() built")
        return Stage3Optimizer(optimizer, sharded, group_offset=group_offset, precision=precision,
                               loss_scaler=loss_scaler, offload_optimizer=offload,
                               pin_memory=config.offload.pin_memory, cross_axis=cross_axis)
    return ZeroOptimizer(optimizer, stage=stage, group=group, precision=precision, loss_scaler=loss_scaler,
                         bucket_mb=config.zero.bucket_mb,
                         overlap_comm=(config.zero.overlap_comm and (not config.partial_grads or (
                             cross_axis is not None and cross_axis.grad_group is not None)))
                         if overlap_comm is None else overlap_comm,
                         offload_optimizer=offload, pin_memory=config.offload.pin_memory, cross_axis=cross_axis)
