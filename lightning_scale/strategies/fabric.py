"""Zero3DFabricStrategy: ZeRO 0-3, offload and tensor parallelism under Lightning Fabric, on the same core.

``Fabric(strategy="zero2" | "zero3" | ..., devices=N)`` or ``Fabric(strategy=Zero3DFabricStrategy(stage=3, tp=2))``::

    with fabric.init_module(empty_init=True):   # meta device where the layout materializes pieces (stage 3, tp)
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)   # over the original parameters: remapped
    model, optimizer = fabric.setup(model, optimizer)            # parallelize() + make_engines()
    with fabric.no_backward_sync(model, enabled=accumulating):
        fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)        # the global norm over dp x tp
    optimizer.step(); optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})   # the Trainer strategy's format

The composition order is :func:`lightning_scale.parallelize.parallelize`; the engines are
:func:`lightning_scale.zero.engine.make_engine`'s; checkpoints are the Trainer strategy's sharded folders
(:mod:`lightning_scale.strategies.checkpoint`), so a Trainer checkpoint loads here and the reverse.
Pipeline parallelism (``pp > 1``) is refused with a ConfigError: its schedule *is* the training step, which a
Fabric loop writes itself; use the Trainer strategy, or ``lightning_scale.pipeline.ZeroPipeline`` in a plain loop.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_scale.config import ConfigError, LossScaleConfig, ParallelConfig, from_flat_kwargs
from lightning_scale.diagnostics.elastic import attempt_store
from lightning_scale.materialize import has_meta
from lightning_scale.parallelize import ParallelModel, check_config, parallelize
from lightning_scale.strategies import stage3 as _stage3
from lightning_scale.strategies.common import GridStrategyMixin
from lightning_scale.strategies.checkpoint import LAYOUT_KEY, load_sharded, save_sharded, sharded_layout
from lightning_scale.topology import Topology
from lightning_scale.zero.engine import ZeroEngine
from lightning_scale.zero.precision import PrecisionPolicy, make_loss_scaler, policy_for


class ZeroFabricPrecision(FabricPrecision):
    """Fabric's precision plugin for the ZeRO engines: low-precision parameters and communication, fp32 masters in
    the shards, dynamic loss scaling for fp16 (one overflow vote over the grid), as ``ZeroPrecision`` for the
    Trainer. The module is cast by the strategy *after* the engines took their fp32 masters."""

    def __init__(self, precision: str = "32-true", loss_scale: Optional[LossScaleConfig] = None) -> None:
        self.policy: PrecisionPolicy = policy_for(precision)
        self.precision = self.policy.name  # type: ignore[assignment]
        self.loss_scaler = make_loss_scaler(self.policy, loss_scale or LossScaleConfig())
        self.device_type = "cpu"
        self.engines: Dict[int, ZeroEngine] = {}

    def engine_for(self, optimizer: Any) -> Optional[ZeroEngine]:
        return self.engines.get(id(getattr(optimizer, "optimizer", optimizer)))

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # see the class docstring: Zero3DFabricStrategy casts after the engines exist

    def forward_context(self):
        if self.policy.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.policy.autocast_dtype)

    def convert_input(self, data: Any) -> Any:
        return data

    def convert_output(self, data: Any) -> Any:
        return data

    def backward(self, tensor: torch.Tensor, model: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self.policy.loss_scaling:
            tensor = tensor * self.loss_scaler.scale
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        engine = self.engine_for(optimizer)
        if engine is None:
            return optimizer.step(**kwargs)
        engine.reduce_gradients()  # the rest of the reduction, unscale, the all-rank overflow decision
        return engine.step()  # skipped (and the loss scale backed off) when any rank overflowed

    def state_dict(self) -> Dict[str, Any]:
        return {"precision": self.precision, **self.loss_scaler.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if state_dict.get("scale") is not None:
            self.loss_scaler.load_state_dict(state_dict)


class _EngineNoSync(_BackwardSyncControl):
    def __init__(self, strategy: "Zero3DFabricStrategy") -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if enabled:
            for engine in self.strategy.engines:
                stack.enter_context(engine.no_sync())
        return stack


class _SequenceShards:
    """A dataloader whose batches are cut to this sp rank's slice; everything else is the loader's own."""

    def __init__(self, dataloader: Any, strategy: "Zero3DFabricStrategy") -> None:
        self._dataloader, self._strategy = dataloader, strategy

    def __iter__(self):
        for batch in self._dataloader:
            yield self._strategy.shard_batch(batch)

    def __len__(self) -> int:
        return len(self._dataloader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_dataloader"], name)


class Zero3DFabricStrategy(GridStrategyMixin, ParallelStrategy):
    strategy_name = "zero3d"

    def __init__(self, config: Optional[ParallelConfig] = None, *, accelerator: Optional[Accelerator] = None,
                 parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision: Optional[str] = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 **options: Any) -> None:
        if config is not None and options:
            raise ConfigError(f"pass either config=ParallelConfig(...) or options, not both (got {sorted(options)})")
        self.config = (config or from_flat_kwargs(**options)).validate()
        if self.config.pp > 1:
            raise ConfigError(f"pp={self.config.pp}: pipeline parallelism is not available under Fabric (its schedule "
                              "is the training step, which a Fabric loop writes itself); use the Trainer's "
                              "Zero3DStrategy, or lightning_scale.pipeline.ZeroPipeline in a plain torch loop")
        self._precision_override = precision
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=None)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._backward_sync_control = _EngineNoSync(self)
        self.topology: Optional[Topology] = None
        self._parallel: Optional[ParallelModel] = None
        self._names: Dict[int, str] = {}
        self.engines: List[ZeroEngine] = []

    # ------------------------------------------------------------------ plumbing
    @property
    def precision(self) -> ZeroFabricPrecision:
        return self._precision if self._precision is not None else ZeroFabricPrecision()

    @precision.setter
    def precision(self, plugin: Optional[FabricPrecision]) -> None:
        if self._precision_override is not None:
            plugin = ZeroFabricPrecision(self._precision_override, self.config.loss_scale)
        elif plugin is not None and not isinstance(plugin, ZeroFabricPrecision):
            plugin = ZeroFabricPrecision(str(getattr(plugin, "precision", "32-true")), self.config.loss_scale)
        self._precision = plugin

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        device_type = self.root_device.type
        if device_type not in ("cpu", "cuda"):
            raise ConfigError(f"accelerator={device_type!r}: Zero3DFabricStrategy runs on 'cpu' (gloo) or 'gpu' "
                              "(CUDA, NCCL)")
        self.precision.device_type = device_type
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        self.config.validate(self.world_size)  # every rank raises the same error: no hang
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        store = None if torch.distributed.is_initialized() else attempt_store(self._timeout)  # diagnostics.elastic
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              **({} if store is None else {"store": store}))
        cfg = self.config
        self.topology = Topology.of(cfg, self.world_size, self.global_rank)
        self.topology.build_groups()
        check_config(cfg)
        _stage3.check_offload(self)

    # ------------------------------------------------------------------ model + optimizers
    def module_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        """``empty_init=True`` where the layout materializes pieces (stage 3, tp): the meta device, rank 0's RNG."""
        cfg = self.config
        if empty_init and cfg.meta_init and (cfg.zero.stage == 3 or cfg.tp_axis > 1):
            return _stage3.meta_init_context(self.root_device)
        return super().module_init_context(empty_init)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: List[torch.optim.Optimizer],
                                    scheduler: Optional[Any] = None):
        self._setup(module, optimizers)
        return module, optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        self._setup(module, [])
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """An optimizer created after ``setup_module`` (over the local parameters) or before it (remapped)."""
        pm = self._parallel
        if pm is None:
            raise ConfigError("set up the model first: fabric.setup(model, optimizer) or fabric.setup_module(model)")
        if pm.sharded is not None:
            raise ConfigError("zero.stage=3 shards by the optimizer's param groups: set the model up together with "
                              "its optimizer, model, optimizer = fabric.setup(model, optimizer)")
        from lightning_scale.parallelize import _resolve_optimizers

        _resolve_optimizers(pm, [optimizer], self._names)
        pm.optimizers.append(optimizer)
        self._make_engines(pm, [optimizer])
        return optimizer

    def _setup(self, module: nn.Module, optimizers: List[torch.optim.Optimizer]) -> None:
        if self._parallel is not None:
            raise ConfigError("Zero3DFabricStrategy sets up one model; create one Fabric per model")
        cfg = self.config
        self._names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        pm = self._parallel = parallelize(
            module, cfg, self.topology, self.root_device, optimizers=optimizers or None, timeout=self._timeout,
            param_dtype=self.precision.policy.param_dtype if cfg.zero.stage == 3 else None)
        self._make_engines(pm, pm.optimizers)
        if cfg.zero.stage != 3 and self.precision.policy.param_dtype is not None:
            module.to(self.precision.policy.param_dtype)  # what the engines did not own (buffers, frozen params)

    def _make_engines(self, pm: ParallelModel, optimizers: List[torch.optim.Optimizer]) -> None:
        plugin = self.precision
        every = pm.make_engines(precision=plugin.policy, loss_scaler=plugin.loss_scaler,
                                overlap_comm=None if len(pm.optimizers) == 1 else False)
        by_id = {id(o): e for o, e in zip(pm.optimizers, every)}
        for opt in optimizers:
            plugin.engines[id(opt)] = by_id[id(opt)]
        self.engines = [by_id[id(o)] for o in pm.optimizers]

    # ------------------------------------------------------------------ sequence parallelism (sp > 1)
    def process_dataloader(self, dataloader: Any) -> Any:
        """``fabric.setup_dataloaders``: the sampler splits over dp only; under sp every batch is cut to this rank's
        1/sp of each sequence (:meth:`shard_batch`) as it is drawn."""
        dataloader = super().process_dataloader(dataloader)
        if self.config.sp == 1:
            return dataloader
        return _SequenceShards(dataloader, self)

    def shard_batch(self, batch: Any) -> Any:
        """This sp rank's slice of ``batch`` (dimension 1 of every tensor with two or more dimensions; the batch
        itself at sp == 1): for a Fabric loop that builds its batches without ``fabric.setup_dataloaders``. The
        model's own loss (``GPT.loss``, a Hugging Face model's ``labels=``) is then the whole-sequence mean."""
        topo = self.topology
        if topo is None or topo.sp == 1:
            return batch
        from lightning_scale.sequence_parallel import shard_sequence

        return shard_sequence(batch, topo.sp_rank, topo.sp)

    def module_to_device(self, module: nn.Module) -> None:
        if self.config.zero.stage == 3 or has_meta(module, recurse=True):
            return  # parallelize() places what this rank holds
        module.to(self.root_device)

    def _engine(self, optimizer: Any) -> ZeroEngine:
        engine = self.precision.engine_for(optimizer)
        if engine is None:
            raise ConfigError("this optimizer was not set up by Fabric: fabric.setup(model, optimizer)")
        return engine

    def clip_gradients_norm(self, module: nn.Module, optimizer: Any, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        engine = self._engine(optimizer)
        norm = engine.clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not self.precision.policy.loss_scaling and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is non-finite ({float(norm)}), so it cannot be "
                               "clipped; pass error_if_nonfinite=False to skip this check")
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: Union[float, int]) -> None:
        self._engine(optimizer).clip_grad_value_(float(clip_val))

    # ------------------------------------------------------------------ collectives
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available

        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints (the Trainer strategy's format)
    def _module_state(self) -> Dict[str, Any]:
        pm = self._parallel
        if pm.sharded is not None:
            return _stage3.small_state_dict(pm)  # the parameter shards go to each rank's file
        if pm.model_parallel:
            return pm.full_state_dict()  # collective: the original keys and shapes
        return pm.module.state_dict()

    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if filter:
            raise ConfigError("Zero3DFabricStrategy: fabric.save(filter=...) is not supported (sharded states)")
        import lightning

        modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
        opts = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        if self._parallel is None or len(modules) != 1 or state[modules[0]] is not self._parallel.module:
            raise ConfigError("fabric.save: the state must hold the one model set up by this strategy")
        ckpt: Dict[str, Any] = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()
                                if k not in modules and k not in opts}
        ckpt.update({"state_dict": self._module_state(), "pytorch-lightning_version": lightning.__version__,
                     "optimizer_states": [self._engine(state[k]).state_dict() for k in opts],
                     "fabric": {"module": modules[0], "optimizers": opts}, "precision": self.precision.state_dict()})
        if self.config.zero.stage >= 1 and self.world_size > 1:
            if self._parallel.sharded is not None:
                ckpt[_stage3.SHARD_KEY] = _stage3.shard_checkpoint(self._parallel)
            ckpt[LAYOUT_KEY] = sharded_layout(self)  # loaded on another layout / stage: refused by name
            save_sharded(ckpt, str(path), self.global_rank, self.world_size, self.broadcast, self._gather_object,
                         per_rank_keys=("optimizer_states", _stage3.SHARD_KEY))
        elif self.is_global_zero:
            self.checkpoint_io.save_checkpoint(ckpt, path, storage_options=storage_options)
        self.barrier()

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        import os

        if os.path.isdir(str(path)):
            # the optimizer shards are read when the state holds an optimizer (else only a stage-3 change matters)
            fitting = isinstance(state, Mapping) and any(isinstance(v, torch.optim.Optimizer) for v in state.values())
            ckpt = load_sharded(str(path), self.global_rank, self.world_size, expect=sharded_layout(self),
                                fitting=fitting)
        else:
            ckpt = self.checkpoint_io.load_checkpoint(path, weights_only=False)
        if not state:
            return ckpt
        if not isinstance(state, Mapping):
            raise ConfigError("fabric.load with Zero3DFabricStrategy: pass the state dict given to fabric.save")
        opt_index = 0
        for name, obj in list(state.items()):
            if isinstance(obj, nn.Module):
                self._load_module(ckpt, strict)
            elif isinstance(obj, torch.optim.Optimizer):
                self._engine(obj).load_state_dict(ckpt["optimizer_states"][opt_index])
                opt_index += 1
            elif name in ckpt:
                if hasattr(obj, "load_state_dict"):
                    obj.load_state_dict(ckpt[name])
                else:
                    state[name] = ckpt[name]  # type: ignore[index]
            elif strict:
                raise KeyError(f"fabric.load: {name!r} is not in the checkpoint {path} (keys: {sorted(ckpt)[:12]})")
        if "precision" in ckpt:
            self.precision.load_state_dict(ckpt["precision"])
        taken = {"state_dict", "optimizer_states", _stage3.SHARD_KEY, *state.keys()}
        return {k: v for k, v in ckpt.items() if k not in taken}

    def _load_module(self, ckpt: Dict[str, Any], strict: bool) -> None:
        pm = self._parallel
        if pm.sharded is not None:
            _stage3.load_stage3(pm, ckpt, strict=strict)
        elif pm.model_parallel:
            pm.load_full_state_dict(ckpt["state_dict"], strict=strict)
        else:
            pm.module.load_state_dict(ckpt["state_dict"], strict=strict)

    def teardown(self) -> None:
        for engine in self.engines:
            engine.remove_hooks()
        super().teardown()

