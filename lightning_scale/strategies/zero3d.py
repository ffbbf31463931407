"""Zero3DStrategy: ZeRO data parallelism (and, as they land, tensor / pipeline parallelism) for Lightning.

``Trainer(strategy="zero2", devices=N, precision="bf16-mixed")`` or
``Trainer(strategy=Zero3DStrategy(stage=1, bucket_mb=50))``. Runs under Lightning's launchers (the
script re-launch by default, torchrun, SLURM) with gloo on CPU and NCCL on GPUs.

Order of setup (all on every rank, so a bad setting raises everywhere before training - no hang):
validate the config against the world size -> build the Topology and its groups -> cast and place
the model -> wrap each optimizer in a ZeroOptimizer -> print the layout / memory table on rank 0.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Dict, Generator, List, Literal, Mapping, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_scale.config import ConfigError, ParallelConfig, from_flat_kwargs
from lightning_scale.strategies.checkpoint import load_sharded, remove_sharded, save_sharded
from lightning_scale.strategies.precision import ZeroPrecision
from lightning_scale.strategies.report import layout_table
from lightning_scale.topology import Topology
from lightning_scale.zero import ZeroOptimizer


class Zero3DStrategy(ParallelStrategy):
    strategy_name = "zero3d"

    def __init__(self, config: Optional[ParallelConfig] = None, *, accelerator=None,
                 parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision_plugin: Optional[Precision] = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 precision: Optional[str] = None, **options: Any) -> None:
        if config is not None and options:
            raise ConfigError(f"pass either config=ParallelConfig(...) or options, not both (got {sorted(options)})")
        self.config = (config or from_flat_kwargs(**options)).validate()
        # `precision=` here wins over the Trainer's flag (Lightning turns '16-mixed' on CPU into bf16).
        self._precision_override = precision
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self.topology: Optional[Topology] = None
        self.engines: List[ZeroOptimizer] = []

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to insert a DistributedSampler (split over the dp axis only)."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        # Tensor- and pipeline-parallel peers read the same batch: only the dp axis splits data.
        topo = self.topology
        if topo is None:
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}
        return {"num_replicas": topo.dp, "rank": topo.dp_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is not None and not isinstance(plugin, ZeroPrecision):
            plugin = ZeroPrecision(getattr(plugin, "precision", "32-true"), self.config.loss_scale)
        if self._precision_override is not None:
            plugin = ZeroPrecision(self._precision_override, self.config.loss_scale)
        self._precision_plugin = plugin

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        self._check_accelerator()
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self.config.validate(self.world_size)  # every rank raises the same error: no hang
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        kwargs: Dict[str, Any] = {"timeout": self._timeout}
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        cfg = self.config
        self.topology = Topology(dp=cfg.resolved_dp(self.world_size), pp=cfg.pp, tp=cfg.tp, rank=self.global_rank)
        self.topology.build_groups()
        self._check_supported()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _check_accelerator(self) -> None:
        device_type = self.root_device.type
        if device_type not in ("cpu", "cuda"):
            raise ConfigError(f"accelerator={device_type!r}: Zero3DStrategy runs on 'cpu' (gloo) or 'gpu' (CUDA, NCCL)")
        plugin = self.precision_plugin
        if isinstance(plugin, ZeroPrecision):
            plugin.device_type = device_type
            dtype = plugin.policy.param_dtype
            if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                raise ConfigError(f"precision={plugin.precision!r}: this GPU does not support bfloat16")

    def _check_supported(self) -> None:
        self._check_supported_zero()
        self._check_supported_model_parallel()

    def _check_supported_zero(self) -> None:
        cfg = self.config
        if cfg.zero.stage == 3:
            raise ConfigError("zero.stage=3 is not available in this build yet; use stage 0, 1 or 2")
        if cfg.offload.enabled:
            raise ConfigError("offload is not available in this build yet; use offload='none'")

    # ------------------------------------------------------------------ tensor / pipeline parallel (issues 4, 5)
    def _check_supported_model_parallel(self) -> None:
        cfg = self.config
        if cfg.tp > 1 or cfg.pp > 1:
            raise ConfigError(f"tp={cfg.tp}, pp={cfg.pp}: tensor/pipeline parallelism is not wired into "
                              "Zero3DStrategy in this build yet; use tp=1, pp=1")

    def _apply_model_parallel(self, trainer) -> None:
        """Slice (tp plan) / partition (pp stage) the model after every rank holds rank 0's full weights."""

    # ------------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        self._broadcast_module_states(self.model)
        self._apply_model_parallel(trainer)  # no-op at tp == pp == 1
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            self._wrap_optimizers(trainer)
        self.model = self.precision_plugin.convert_module(self.model)  # casts what the engines did not own
        self.setup_precision_plugin()
        if fitting and self.is_global_zero:
            print(layout_table(self), flush=True)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @torch.no_grad()
    def _broadcast_module_states(self, module: torch.nn.Module) -> None:
        """Every rank starts from rank 0's parameters and buffers (seeds can differ per rank)."""
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)

    def _wrap_optimizers(self, trainer) -> None:
        module = self.lightning_module
        owned = {id(p) for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
        missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise ConfigError(
                f"trainable parameter(s) {missing[:5]} are in no optimizer param group returned by "
                "configure_optimizers; add them or set requires_grad=False"
            )
        plugin = self.precision_plugin
        automatic = module.automatic_optimization
        self.engines = []
        for opt in self.optimizers:
            if getattr(opt, "handles_gradient_reduction", False):
                # It reduces its own gradients (1-bit Adam): no ZeRO wrapping, no double communication.
                if hasattr(opt, "check_zero_stage"):
                    opt.check_zero_stage(self.config.zero.stage)
                opt.bind_process_group(self.topology.dp_group)
                continue
            engine = ZeroOptimizer(
                opt, stage=self.config.zero.stage, group=self.topology.dp_group, precision=plugin.policy,
                loss_scaler=plugin.loss_scaler if isinstance(plugin, ZeroPrecision) else None,
                bucket_mb=self.config.zero.bucket_mb,
                # Manual optimization may run several backwards per step: reduce at step() instead.
                overlap_comm=self.config.zero.overlap_comm and automatic and len(self.optimizers) == 1,
            )
            self.engines.append(engine)
            plugin.register_engine(opt, engine)

    # ------------------------------------------------------------------ training hooks
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning wraps non-final gradient-accumulation micro-batches in this: no communication."""
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.no_sync())
            yield

    def _engine(self, optimizer: Any) -> Optional[ZeroOptimizer]:
        plugin = self.precision_plugin
        return plugin.engine_for(optimizer) if isinstance(plugin, ZeroPrecision) else None

    # ------------------------------------------------------------------ collectives for Lightning
    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        engine = self._engine(optimizer)
        return engine.state_dict() if engine is not None else optimizer.state_dict()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            engine = self._engine(opt)
            (engine or opt).load_state_dict(state)

    @property
    def _sharded_checkpoint(self) -> bool:
        return self.config.zero.stage >= 1 and self.world_size > 1

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self._sharded_checkpoint:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        save_sharded(checkpoint, str(filepath), self.global_rank, self.world_size, self.barrier)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = str(checkpoint_path)
        if os.path.isdir(path):
            return load_sharded(path, self.global_rank, self.world_size)
        return self.checkpoint_io.load_checkpoint(path, weights_only=False)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            if os.path.isdir(str(filepath)):
                remove_sharded(str(filepath))
            else:
                self.checkpoint_io.remove_checkpoint(filepath)

    def teardown(self) -> None:
        for engine in self.engines:
            engine.reducer.remove_hooks()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        presets = {
            "zero3d": ({}, "ZeRO data parallelism (stage 2 by default); tp/pp/offload by options"),
            "zero0": ({"stage": 0}, "ZeRO stage 0: bucketed all-reduce overlapped with backward (DDP)"),
            "zero1": ({"stage": 1}, "ZeRO stage 1: optimizer state and fp32 master weights sharded"),
            "zero2": ({"stage": 2}, "ZeRO stage 2: stage 1 + gradients reduce-scattered during backward"),
        }
        for name, (kwargs, description) in presets.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=description, **kwargs)
