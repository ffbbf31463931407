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

from lightning_scale.config import PRESETS, ConfigError, ParallelConfig, from_flat_kwargs
from lightning_scale.materialize import has_meta
from lightning_scale.strategies.checkpoint import load_sharded, remove_sharded, save_sharded
from lightning_scale.strategies.model_parallel import ModelParallel
from lightning_scale.strategies.precision import ZeroPrecision
from lightning_scale.strategies.report import layout_table
from lightning_scale.strategies import stage3 as _stage3
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
        self.sharded = None  # ShardedParameters at zero.stage=3
        self._model_parallel: Optional[ModelParallel] = None  # tp / pp glue (issues 4, 5); None at tp == pp == 1

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
        _stage3.check_offload(self)

    # ------------------------------------------------------------------ ZeRO-3 (lightning_scale/strategies/stage3.py)
    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device at zero.stage=3 (setup materializes unit by unit) and under
        pipeline parallelism without tp (each rank materializes only its own stage)."""
        if not self._deferred_init:
            yield
            return
        with _stage3.meta_init_context(self.root_device):
            yield

    @property
    def _deferred_init(self) -> bool:
        """Whether ``configure_model`` runs on the meta device: at ZeRO-3 (units materialized one at a time), with
        pipelines (each rank materializes its own stage) and with tp (the plan splits the meta model; each rank
        materializes only its slices, initialized as slices of the full layers). ``meta_init=False`` turns it off
        (a ``configure_model`` that loads pretrained weights needs real tensors)."""
        cfg = self.config
        return cfg.meta_init and (cfg.zero.stage == 3 or cfg.pp > 1 or cfg.tp > 1)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """ZeRO-3 restores parameter shards into the engine that setup builds; a pipeline built on meta loads the
        checkpoint into its materialized stage."""
        return self.config.zero.stage == 3 or self._deferred_init

    def full_state_dict(self, rank0_only: bool = False) -> Dict[str, Any]:
        """The whole model's parameters (fp32 masters where they exist, else the parameters' own dtype) and buffers,
        unsharded, with the original keys and shapes. A collective."""
        if self.sharded is None:
            if self._model_parallel is not None and self._model_parallel.module is not None:
                return {k: v.detach().cpu() for k, v in self._model_parallel.full_state_dict().items()}
            return {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        full = self.sharded.full_state_dict(dtype=None, rank0_only=False if self._model_parallel else rank0_only)
        if self._model_parallel is not None:  # tp slices -> original shapes; pipeline stages -> the whole model
            full = self._model_parallel.consolidate_stage3(full)
            if rank0_only and self.global_rank != 0:
                return {}
        return full

    # ------------------------------------------------------------------ tensor / pipeline parallel (issues 4, 5)
    def _check_supported_model_parallel(self) -> None:
        cfg = self.config
        if cfg.tp > 1 or cfg.pp > 1:
            ModelParallel.check_config(cfg)
            if self._model_parallel is None:
                self._model_parallel = ModelParallel(cfg, self.topology)

    def _apply_model_parallel(self, trainer) -> None:
        """Slice (tp plan) / partition (pp stage) the model after every rank holds rank 0's full weights."""
        if self._model_parallel is not None:
            self._model_parallel.apply(self.lightning_module, timeout=self._timeout, device=self.root_device)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self.config.zero.stage == 3:
            fitting = trainer.state.fn == TrainerFn.FITTING
            if self._model_parallel is not None and self.sharded is None:
                # ZeRO-3 x tp: the plan splits the model (on meta: ShardedParameters then materializes each unit's
                # slices; built for real: rank 0's weights first), then the slices are sharded over dp
                if not has_meta(self.model, recurse=True):
                    self.model.to(self.root_device)
                    self._broadcast_module_states(self.model)
                self._apply_model_parallel(trainer)
            _stage3.setup_stage3(self, trainer, fitting)
            self.setup_precision_plugin()
            if fitting and self.is_global_zero:
                print(layout_table(self), flush=True)
            return
        deferred = self._model_parallel is not None and has_meta(self.model, recurse=True)
        if not deferred:
            self.model_to_device()
            self._broadcast_module_states(self.model)
        self._apply_model_parallel(trainer)  # no-op at tp == pp == 1; pp from meta: materializes this stage only
        if deferred:
            self.model_to_device()
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
        if self.config.zero.stage == 3:
            return  # the ZeRO-3 engine places shards and gathered buffers itself
        self.model.to(self.root_device)

    @torch.no_grad()
    def _broadcast_module_states(self, module: torch.nn.Module) -> None:
        """Every rank starts from rank 0's parameters and buffers (seeds can differ per rank)."""
        if self._model_parallel is not None and self._model_parallel.applied_to(self.lightning_module):
            return  # validate/test after fit: already split, rank 0 holds only its own tp slices / stage
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
        # tp / pp (issues 4, 5): an engine whose norm, clipping and overflow span the tp and pp groups too
        engine_cls, mp_kwargs = self._model_parallel.engine_factory() if self._model_parallel else (ZeroOptimizer, {})
        for opt in self.optimizers:
            if self._model_parallel is not None:
                self._model_parallel.check_optimizer(opt)
            if getattr(opt, "handles_gradient_reduction", False):
                # It reduces its own gradients (1-bit Adam): no ZeRO wrapping, no double communication.
                if hasattr(opt, "check_zero_stage"):
                    opt.check_zero_stage(self.config.zero.stage)
                opt.bind_process_group(self.topology.dp_group)
                # issue 6: OneBitAdam at ZeRO 1/2 gets its own engine (sharded state, 1-bit reduce-scatter
                # onto the shards); at stage 0 the optimizer communicates by itself, as above.
                from lightning_scale.optim import OneBitAdam
                from lightning_scale.zero.onebit import OneBitZeroOptimizer

                if isinstance(opt, OneBitAdam) and self.config.zero.stage in (1, 2):
                    engine = OneBitZeroOptimizer(
                        opt, stage=self.config.zero.stage, group=self.topology.dp_group, precision=plugin.policy,
                        loss_scaler=plugin.loss_scaler if isinstance(plugin, ZeroPrecision) else None,
                        bucket_mb=self.config.zero.bucket_mb)
                    self.engines.append(engine)
                    plugin.register_engine(opt, engine)
                continue
            engine = engine_cls(
                opt, stage=self.config.zero.stage, group=self.topology.dp_group, precision=plugin.policy,
                loss_scaler=plugin.loss_scaler if isinstance(plugin, ZeroPrecision) else None,
                bucket_mb=self.config.zero.bucket_mb,
                **({"offload_optimizer": True, "pin_memory": self.config.offload.pin_memory}
                   if self.config.offload.optimizer != "none" else {}),
                # Manual optimization may run several backwards per step: reduce at step() instead.
                overlap_comm=self.config.zero.overlap_comm and automatic and len(self.optimizers) == 1
                and not self.config.tensor.sequence_parallel,  # partial grads are summed over tp first
                **mp_kwargs,
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

    # ------------------------------------------------------------------ pipeline parallel steps (issue 5)
    # At pp > 1 the strategy runs the schedule instead of the LightningModule's *_step (contract: README,
    # lightning_scale/strategies/pipeline_glue.py); at pp == 1 these are Lightning's own.
    @property
    def _pipeline(self):
        return self._model_parallel.pipeline if self._model_parallel is not None else None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self.precision_plugin.train_step_context():
            return self._pipeline.train_step(self, args[0], args[1])

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self._pipeline.eval_step(self, "val", args[0], args[1])

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        with self.precision_plugin.test_step_context():
            return self._pipeline.eval_step(self, "test", args[0], args[1])

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self._pipeline.predict_step(self, args[0], args[1])

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        return self._pipeline.backward(self, closure_loss)  # the schedule already ran it

    def process_dataloader(self, dataloader: Any) -> Any:
        if self._pipeline is not None:
            self._pipeline.check_dataloader(dataloader)
        return super().process_dataloader(dataloader)

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

    def _gather_object(self, obj: Any) -> List[Any]:
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        every: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, obj)
        return every

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
        if self.sharded is not None:
            checkpoint[_stage3.SHARD_KEY] = _stage3.shard_checkpoint(self)
        save_sharded(checkpoint, str(filepath), self.global_rank, self.world_size, self.broadcast,
                     self._gather_object, per_rank_keys=("optimizer_states", _stage3.SHARD_KEY))

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

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        if self.sharded is not None:  # ZeRO-3: shards go to each rank's file (save_checkpoint); this is the rest
            return _stage3.small_state_dict(self)
        # tp / pp (issues 4, 5): gathered to the original model's keys and shapes; collective, every rank calls it
        if self._model_parallel is not None and self._model_parallel.module is not None:
            return self._model_parallel.full_state_dict()
        return super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.sharded is not None:
            _stage3.load_stage3(self, dict(checkpoint), strict=strict)
            return
        # tp / pp (issues 4, 5): a consolidated state_dict into an already split model (test(ckpt_path=) after fit)
        if self._model_parallel is not None and self._model_parallel.module is not None:
            self._model_parallel.load_full_state_dict(checkpoint["state_dict"], strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    def teardown(self) -> None:
        for engine in self.engines:
            engine.reducer.remove_hooks()
        if self.sharded is not None:
            # ZeRO-3 keeps its hooks (validate/test/predict after fit gather through them) and does not move the
            # module to the CPU: its parameters are views of freed buffers; the shards stay where they are.
            assert self.cluster_environment is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, (kwargs, description) in PRESETS.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=description, **kwargs)
