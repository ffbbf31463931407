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
import dataclasses
import os
from datetime import timedelta
from typing import Any, Dict, Generator, List, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_scale.config import (FLAT, ConfigError, ParallelConfig, check_trainer_flags, from_flat_kwargs,
                                    speaking)
from lightning_scale.diagnostics.elastic import attempt_store
from lightning_scale.materialize import has_meta
from lightning_scale.parallelize import ParallelModel, check_config, parallelize
from lightning_scale.strategies import compile_glue, diagnostics_glue
from lightning_scale.strategies.common import GridStrategyMixin
from lightning_scale.strategies.checkpoint import (defer_removal, load_sharded, remove_sharded, save_sharded,
                                                   wait_async_save)
from lightning_scale.strategies.pipeline_glue import PipelineGlue
from lightning_scale.strategies.precision import ZeroPrecision
from lightning_scale.strategies.memory_plan import install_memory_plan
from lightning_scale.strategies.expert_load import install_expert_load
from lightning_scale.strategies.tp_replicas import install_replica_check
from lightning_scale.strategies.report import layout_table
from lightning_scale.strategies import stage3 as _stage3
from lightning_scale.topology import Topology
from lightning_scale.zero.engine import ZeroEngine


class Zero3DStrategy(GridStrategyMixin, ParallelStrategy):
    strategy_name = "zero3d"

    def __init__(self, config: Optional[ParallelConfig] = None, *, accelerator=None,
                 parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision_plugin: Optional[Precision] = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 precision: Optional[str] = None, autotune: Any = None, **options: Any) -> None:
        if config is not None and options:
            raise ConfigError(f"pass either config=ParallelConfig(...) or options, not both (got {sorted(options)})")
        # Errors name settings as the user typed them: keywords (stage=5) when built from options; the Hydra front
        # door (hydra_config) renames its own (strategy.stage=5); a ParallelConfig keeps its field paths.
        self._namer = FLAT if config is None else (lambda path: path)
        with speaking(self._namer):
            self.config = (config or from_flat_kwargs(**options)).validate()
        # `precision=` here wins over the Trainer's flag (Lightning turns '16-mixed' on CPU into bf16).
        self._precision_override = precision
        # autotune=True | dict: the layout is measured at setup (lightning_scale/strategies/autotune.py); the
        # keywords given here are fixed, not searched
        self._autotune, self._autotune_given = autotune, (sorted(options) if config is None else None)
        self.autotune_result: Optional[Dict[str, Any]] = None
        if autotune not in (None, False):
            from lightning_scale.strategies.autotune import options as autotune_options

            autotune_options(autotune)  # bad keys: a ConfigError now, not after the launch
            # The layout is picked again at every start (probe timings vary): checkpoints default to the layout-free
            # format, which resumes on whatever the next start picks. A format the user set is kept.
            user_set = ("checkpoint_format" in options if config is None
                        else self.config.checkpoint_format != "sharded")
            if not user_set:
                self.config = dataclasses.replace(self.config, checkpoint_format="universal").validate()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self.topology: Optional[Topology] = None
        self.engines: List[ZeroEngine] = []
        self.sharded = None  # ShardedParameters at zero.stage=3
        self._parallel: Optional[ParallelModel] = None  # what parallelize() built (set in setup)
        self._pipeline: Optional[PipelineGlue] = None  # the Lightning steps at pp > 1

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to insert a DistributedSampler (split over the dp axis only)."""
        return True

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
        with speaking(self._namer):
            self._setup_environment()

    def _setup_environment(self) -> None:
        self._check_accelerator()
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self.config.validate(self.world_size)  # every rank raises the same error: no hang
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        kwargs: Dict[str, Any] = {"timeout": self._timeout}
        if not torch.distributed.is_initialized():  # torchrun: a store namespace per restart (diagnostics.elastic)
            store = attempt_store(self._timeout)
            kwargs.update({} if store is None else {"store": store})
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        cfg = self.config
        self.topology = Topology.of(cfg, self.world_size, self.global_rank)
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
        _stage3.check_offload(self)
        check_config(self.config)  # what the composition cannot run, before any model is touched

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
        return cfg.meta_init and (cfg.zero.stage == 3 or cfg.pp > 1 or cfg.tp_axis > 1)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """ZeRO-3 restores parameter shards into the engine that setup builds; a pipeline built on meta loads the
        checkpoint into its materialized stage; a universal checkpoint loads into the engines that setup builds."""
        return (self.config.zero.stage == 3 or self._deferred_init or self.config.checkpoint_format == "universal"
                # autotune: the layout is picked in setup, so restore into what it built (Lightning asks before and
                # after setup: the answer must not change in between, or the checkpoint is never loaded)
                or self._autotune not in (None, False))

    def full_state_dict(self, rank0_only: bool = False) -> Dict[str, Any]:
        """The whole model's parameters (fp32 masters where they exist, else the parameters' own dtype) and buffers,
        unsharded, with the original keys and shapes. A collective."""
        mp = self._parallel if self._parallel is not None and self._parallel.model_parallel else None
        if self.sharded is None:
            if mp is not None:
                return {k: v.detach().cpu() for k, v in mp.full_state_dict().items()}
            return {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        full = self.sharded.full_state_dict(dtype=None, rank0_only=False if mp is not None else rank0_only)
        if mp is not None:  # tp slices -> original shapes; pipeline stages -> the whole model
            full = mp.consolidate_stage3(full)
            if rank0_only and self.global_rank != 0:
                return {}
        from lightning_scale.zero.shard_state import aliases

        for alias, name in aliases(self.sharded).items():  # a tied head under its own name too (lm_head.weight)
            if name in full:
                full.setdefault(alias, full[name])
        # the model's own state_dict() keys: persistent buffers only (a fresh HF model loads it with strict=True)
        keys = set(self.lightning_module.state_dict(keep_vars=True))
        return {k: v for k, v in full.items() if k in keys}

    # ------------------------------------------------------------------ setup: parallelize() + make_engines()
    def setup(self, trainer) -> None:
        with speaking(self._namer):
            self._setup(trainer)

    def _setup(self, trainer) -> None:
        """The composition order lives in :func:`lightning_scale.parallelize.parallelize`; this only supplies
        Lightning's pieces (``configure_optimizers``, the pipeline loss, the precision policy)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        cfg = self.config
        fitting = trainer.state.fn == TrainerFn.FITTING
        pm = self._parallel
        if pm is not None and pm.module is self.model:  # validate / test / predict after fit, or fit again
            if fitting and cfg.zero.stage == 3:
                raise ConfigError("zero.stage=3: fit() twice with the same strategy object is not supported; "
                                  "create a new Trainer/strategy")
            if fitting:
                self.setup_optimizers(trainer)
                pm.optimizers = list(self.optimizers)
        else:
            if pm is not None and pm.model_parallel:
                raise ConfigError(f"Zero3DStrategy(tp={cfg.tp}, pp={cfg.pp}) was already applied to another "
                                  "LightningModule; use a new strategy object per model")
            if fitting and self._autotune not in (None, False) and self.autotune_result is None:
                from lightning_scale.strategies import autotune

                self.autotune_result = autotune.run(self, trainer, self._autotune, self._autotune_given)
                self._check_supported()
                cfg = self.config
            if cfg.pp > 1:
                PipelineGlue.check_module(self.model, cfg.pp)
            build = (lambda: (self.setup_optimizers(trainer), self.optimizers)[1]) if fitting else None
            pm = self._parallel = parallelize(
                self.model, cfg, self.topology, self.root_device, optimizers=build,
                loss_fn=PipelineGlue.loss_fn(self.model) if cfg.pp > 1 else None, timeout=self._timeout,
                param_dtype=self.precision_plugin.policy.param_dtype if cfg.zero.stage == 3 else None)
            self.sharded = pm.sharded
            self._pipeline = PipelineGlue(pm.pipeline) if pm.pipeline is not None else None
        if fitting:
            self._wrap_optimizers()
        if cfg.zero.stage != 3:
            self.model = self.precision_plugin.convert_module(self.model)  # casts what the engines did not own
        self.setup_precision_plugin()
        if fitting and self.is_global_zero:
            print(layout_table(self), flush=True)
        diagnostics_glue.install(self, trainer)  # watchdog, first error wins, signals, numerics (docs/failures.md)
        if fitting:
            compile_glue.install(self, trainer)  # the compile report after step 1 and at the end
            install_memory_plan(self, trainer)  # step 1's measured peak vs the memory plan (memory_plan.py)
            install_expert_load(self, trainer)  # placed experts: the routes' spread over tp (expert_load.py)
            install_replica_check(self, trainer)  # tp: the parameters kept whole stay equal (tp_replicas.py)

    def gathered(self, module: Optional[torch.nn.Module] = None):
        """The full parameters of ``module`` (default: the whole model) while inside, at every ZeRO stage; e.g. a
        callback that logs weight norms between steps (at stage 3 a bare read raises a clear error)."""
        return diagnostics_glue.gathered(self, module)

    def model_to_device(self) -> None:
        assert self.model is not None
        if self.config.zero.stage == 3:
            return  # the ZeRO-3 engine places shards and gathered buffers itself
        self.model.to(self.root_device)

    def _wrap_optimizers(self) -> None:
        """One engine per optimizer (lightning_scale.zero.engine.make_engine, through the ParallelModel)."""
        cfg, plugin = self.config, self.precision_plugin
        trainer = self.lightning_module.trainer
        for opt in self.optimizers:  # what this layout cannot run with the Trainer's flags: before any step
            check_trainer_flags(cfg, optimizer=type(opt).__name__, gradient_clip_val=trainer.gradient_clip_val)
        automatic = self.lightning_module.automatic_optimization
        self.engines = self._parallel.make_engines(
            precision=plugin.policy, loss_scaler=plugin.loss_scaler if isinstance(plugin, ZeroPrecision) else None,
            # Manual optimization may run several backwards per step: reduce at step() instead. Otherwise the
            # engines' default (zero.overlap_comm, unless partial gradients have no twin group to be summed on).
            overlap_comm=None if automatic and len(self.optimizers) == 1 else False)
        for opt, engine in zip(self.optimizers, self.engines):
            plugin.register_engine(opt, engine)

    # ------------------------------------------------------------------ training hooks
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning wraps non-final gradient-accumulation micro-batches in this: no communication."""
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.no_sync())
            yield

    def _engine(self, optimizer: Any) -> Optional[ZeroEngine]:
        plugin = self.precision_plugin
        return plugin.engine_for(optimizer) if isinstance(plugin, ZeroPrecision) else None

    # ------------------------------------------------------------------ pipeline parallel steps (issue 5)
    # At pp > 1 the strategy runs the schedule instead of the LightningModule's *_step (contract: README,
    # lightning_scale/strategies/pipeline_glue.py); at pp == 1 these are Lightning's own.
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

    def batch_to_device(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Under sequence parallelism (sp > 1) each sp rank keeps its 1/sp of every sequence (dimension 1 of every
        tensor with two or more dimensions); the sampler split the data over dp only."""
        batch = super().batch_to_device(batch, *args, **kwargs)
        topo = self.topology
        if topo is None or topo.sp == 1:
            return batch
        from lightning_scale.sequence_parallel import shard_sequence

        with speaking(self._namer):
            return shard_sequence(batch, topo.sp_rank, topo.sp)

    def process_dataloader(self, dataloader: Any) -> Any:
        if self._pipeline is not None:
            self._pipeline.check_dataloader(dataloader)
        return super().process_dataloader(dataloader)

    # ------------------------------------------------------------------ collectives for Lightning
    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        if self.config.checkpoint_format == "universal":
            return {}  # save_checkpoint streams the engines' pieces: no cloned copy of every master here
        engine = self._engine(optimizer)
        return engine.state_dict() if engine is not None else optimizer.state_dict()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        from lightning_scale.strategies.checkpoint import UNIVERSAL_KEY, load_universal

        if UNIVERSAL_KEY in checkpoint:  # a universal checkpoint: its pieces are in the engines already, or now
            pending, self._universal_pending = getattr(self, "_universal_pending", None), None
            if pending is not None:  # read before setup (zero.stage < 3, no tp / pp): the engines exist now
                load_universal(self, pending)
            return
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            engine = self._engine(opt)
            (engine or opt).load_state_dict(state)

    @property
    def _sharded_checkpoint(self) -> bool:
        return self.config.zero.stage >= 1 and self.world_size > 1

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.config.checkpoint_format == "universal":  # layout-free: resumes on any dp / stage (docs/checkpoints.md)
            from lightning_scale.strategies.checkpoint import save_universal

            save_universal(self, checkpoint, str(filepath))
            return
        if not self._sharded_checkpoint:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if self.sharded is not None:
            checkpoint[_stage3.SHARD_KEY] = _stage3.shard_checkpoint(self._parallel)
        from lightning_scale.strategies.checkpoint import LAYOUT_KEY, sharded_layout

        checkpoint[LAYOUT_KEY] = sharded_layout(self)  # resumed on another layout / stage: refused by name
        save_sharded(checkpoint, str(filepath), self.global_rank, self.world_size, self.broadcast,
                     self._gather_object, per_rank_keys=("optimizer_states", _stage3.SHARD_KEY))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        from lightning_scale.strategies.checkpoint import resume_epoch_end_as_last_batch

        # an epoch-end checkpoint restarts as its last batch's end would (Lightning #19403: else one extra batch)
        return resume_epoch_end_as_last_batch(self._read_checkpoint(checkpoint_path))

    def _read_checkpoint(self, checkpoint_path: Any) -> Dict[str, Any]:
        path = str(checkpoint_path)
        wait_async_save(self)  # checkpoint_async: a save still in flight is written first
        if os.path.isdir(path):
            from lightning_scale.checkpoint.dcp_format import detect_format

            if detect_format(path) == "dcp":  # the layout-free format, written by any layout
                from lightning_scale.strategies.checkpoint import UNIVERSAL_KEY, load_universal, read_lightning_state

                if self.restore_checkpoint_after_setup and self.engines:
                    return load_universal(self, path)
                # Before setup (no engines yet): Lightning's state now, the pieces in load_optimizer_state_dict /
                # load_model_state_dict once the layout exists.
                self._universal_pending = path
                return dict(read_lightning_state(path), **{UNIVERSAL_KEY: None})
            return load_sharded(path, self.global_rank, self.world_size, **self._sharded_expectation())
        return self.checkpoint_io.load_checkpoint(path, weights_only=False)

    def _sharded_expectation(self) -> Dict[str, Any]:
        """load_sharded's layout check: the layout this run has (none while the autotuner has not picked it yet)."""
        from lightning_scale.strategies.checkpoint import sharded_layout

        if self._autotune_pending:
            return {}
        trainer = getattr(self.lightning_module, "_trainer", None)  # (.trainer raises when none is attached)
        fitting = trainer is None or trainer.state.fn == TrainerFn.FITTING
        hint = ""
        if self.autotune_result is not None:
            hint = ("Zero3DStrategy(autotune=...) picked this layout at this start; pin the checkpoint's layout by "
                    "hand (its settings, or autotune restricted to them) to resume it.")
        return {"expect": sharded_layout(self), "fitting": fitting, "hint": hint}

    @property
    def _autotune_pending(self) -> bool:
        """autotune=... is set and has not picked the layout yet (the config is not final)."""
        return self._autotune not in (None, False) and self.autotune_result is None

    def wait_checkpoint_snapshot(self) -> None:
        """checkpoint_async="overlap": block until the save in flight has copied the state it writes; code that edits
        weights or optimizer state between steps (outside an optimizer step) calls this first."""
        saver = getattr(self, "_async", None)
        if saver is not None:
            saver.fence()

    def remove_checkpoint(self, filepath: Any) -> None:
        wait_async_save(self, filepath)  # only when the save in flight writes that very folder
        if defer_removal(self, filepath):  # another save is in flight: removed once it is written
            return
        if self.is_global_zero:
            if os.path.isdir(str(filepath)):
                remove_sharded(str(filepath))
            else:
                self.checkpoint_io.remove_checkpoint(filepath)

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        if self.config.checkpoint_format == "universal":  # save_checkpoint writes the engines' pieces instead
            return {}
        if self.sharded is not None:  # ZeRO-3: shards go to each rank's file (save_checkpoint); this is the rest
            return _stage3.small_state_dict(self._parallel)
        # tp / pp (issues 4, 5): gathered to the original model's keys and shapes; collective, every rank calls it
        if self._parallel is not None and self._parallel.model_parallel:
            return self._parallel.full_state_dict()
        return super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        from lightning_scale.strategies.checkpoint import UNIVERSAL_KEY, load_universal_weights

        if UNIVERSAL_KEY in checkpoint:  # in the engines already / at load_optimizer_state_dict when fitting
            fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
            if not fitting and getattr(self, "_universal_pending", None) is not None:  # validate / test: weights
                pending, self._universal_pending = self._universal_pending, None
                load_universal_weights(self, pending)
            return
        if self.sharded is not None:
            _stage3.load_stage3(self._parallel, dict(checkpoint), strict=strict)
            return
        # tp / pp (issues 4, 5): a consolidated state_dict into an already split model (test(ckpt_path=) after fit)
        if self._parallel is not None and self._parallel.model_parallel:
            self._parallel.load_full_state_dict(checkpoint["state_dict"], strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    def teardown(self) -> None:
        # Each step runs; while fit's first error propagates, a failing one is logged as secondary, not raised.
        diagnostics_glue.run_teardown(
            self, ("the async checkpoint save", lambda: wait_async_save(self)),  # the last save is complete
            ("Zero3DStrategy.teardown", self._teardown))

    def _teardown(self) -> None:
        for engine in self.engines:
            engine.remove_hooks()
        # A model still on meta (setup refused a setting before sharding) must not be moved: that secondary
        # "Cannot copy out of meta tensor" would bury the first error.
        if self.sharded is not None or (self.model is not None and has_meta(self.model, recurse=True)):
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
