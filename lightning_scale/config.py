"""Configuration: frozen, keyword-only dataclasses validated before any process group or model exists.

``ParallelConfig`` is the one schema. What the front doors take is derived from it:

* the flat keyword arguments of ``Zero3DStrategy(**options)`` (``from_flat_kwargs``): every field by its flat
  name (``stage``, ``microbatches``, ``plan``...; ``FLAT_NAMES`` lists the few that are not the field's name);
* the Hydra ``strategy`` node (``lightning_scale.hydra_config.StrategyConf``: ``strategy.<flat name>``);
* the registered strategy names (``PRESETS``: flat keyword arguments over the defaults).

Errors speak the user's words. ``validate()`` raises ``ConfigError`` naming the internal path
(``"zero.stage=5: must be one of 0, 1, 2, 3"``); each front door renames the paths it finds in the message
(``speaking(FLAT)``: ``stage=5``; ``speaking(HYDRA)``: ``strategy.stage=5``; a Trainer flag:
``gradient_clip_val`` / ``trainer.gradient_clip_val``). Code built on ``ParallelConfig(...)`` itself keeps the
internal paths, which are then the user's words. The flat schema, the renaming and the presets live in
:mod:`lightning_scale.config_flat` and are re-exported here.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
OFFLOAD_DEVICES = ("none", "cpu")
CHECKPOINT_FORMATS = ("sharded", "universal")
ACTIVATION_CHECKPOINTING = ("full", "selective")  # None: off (docs/long_sequences.md)
# The torch.compile keyword arguments a compile={...} dict may set (lightning_scale.compile).
COMPILE_OPTIONS = ("backend", "mode", "fullgraph", "dynamic", "options", "disable")


class ConfigError(ValueError):
    """A setting is impossible or unknown; the message names it.

    ``settings``: internal paths the message names that a front door should rename even where they are not
    written ``path=value`` (top-level names such as ``tp`` are renamed only then, or when listed here).
    """

    def __init__(self, message: str, *, settings: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.settings = tuple(settings)
        self.spoken = False  # renamed by a front door already (the innermost door is the one the user used)

    def renamed(self, namer: Callable[[str], str]) -> "ConfigError":
        """The same error with every internal path in its message replaced by ``namer(path)``."""
        err = ConfigError(_rename(str(self), namer, self.settings), settings=[namer(s) for s in self.settings])
        err.spoken = True
        return err


def _check_compile(value: Any) -> None:
    if isinstance(value, bool) or value is None:
        return
    if not isinstance(value, Mapping):
        raise ConfigError(f"compile={value!r} must be True, False or a dict of torch.compile options "
                          f"({', '.join(COMPILE_OPTIONS)})")
    for key in value:
        if key not in COMPILE_OPTIONS:
            close = difflib.get_close_matches(str(key), COMPILE_OPTIONS, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"compile: unknown torch.compile option {key!r}{hint}; known: "
                              f"{', '.join(COMPILE_OPTIONS)}")
    if value.get("mode") is not None and value.get("options") is not None:
        raise ConfigError("compile: torch.compile takes either 'mode' or 'options', not both")


def _check_choice(name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: must be one of {', '.join(map(str, choices))}")


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (ignored for other precisions)."""

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 1

    def validate(self) -> "LossScaleConfig":
        if self.initial_scale <= 0:
            raise ConfigError(f"loss_scale.initial_scale={self.initial_scale} must be > 0")
        if self.growth_factor <= 1:
            raise ConfigError(f"loss_scale.growth_factor={self.growth_factor} must be > 1")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError(f"loss_scale.backoff_factor={self.backoff_factor} must be in (0, 1)")
        if self.growth_interval < 1:
            raise ConfigError(f"loss_scale.growth_interval={self.growth_interval} must be >= 1")
        if self.min_scale <= 0:
            raise ConfigError(f"loss_scale.min_scale={self.min_scale} must be > 0")
        if self.hysteresis < 1:
            raise ConfigError(f"loss_scale.hysteresis={self.hysteresis} must be >= 1")
        return self


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where optimizer state / master weights (``optimizer``) and stage-3 parameters (``params``) live."""

    optimizer: str = "none"
    params: str = "none"
    pin_memory: bool = True

    def validate(self, stage: int) -> "OffloadConfig":
        _check_choice("offload.optimizer", self.optimizer, OFFLOAD_DEVICES)
        _check_choice("offload.params", self.params, OFFLOAD_DEVICES)
        # No value in the message: the flat / Hydra key is the shorthand offload='optimizer' | 'params' | 'all'.
        if self.optimizer != "none" and stage == 0:
            raise ConfigError("offload.optimizer: optimizer offload needs zero.stage >= 1 (got zero.stage=0; "
                              "stage 0 keeps no optimizer shard)")
        if self.params != "none" and stage != 3:
            raise ConfigError(f"offload.params: parameter offload needs zero.stage=3 (got zero.stage={stage})")
        return self

    @property
    def enabled(self) -> bool:
        return self.optimizer != "none" or self.params != "none"


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: int = 2
    bucket_mb: float = 25.0
    overlap_comm: bool = True
    # stage 3
    prefetch_depth: int = 1
    persistent_threshold: int = 0
    unit_modules: Optional[tuple] = None

    def validate(self) -> "ZeroConfig":
        _check_choice("zero.stage", self.stage, (0, 1, 2, 3))
        if not self.bucket_mb > 0:
            raise ConfigError(f"zero.bucket_mb={self.bucket_mb} must be > 0")
        if self.prefetch_depth < 0:
            raise ConfigError(f"zero.prefetch_depth={self.prefetch_depth} must be >= 0")
        if self.persistent_threshold < 0:
            raise ConfigError(f"zero.persistent_threshold={self.persistent_threshold} must be >= 0")
        return self


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    partition: str = "parameters"

    def validate(self, pp: int) -> "PipelineConfig":
        if self.microbatches < 1:
            raise ConfigError(f"pipeline.microbatches={self.microbatches} must be >= 1")
        _check_choice("pipeline.schedule", self.schedule, SCHEDULES)
        if self.virtual_stages < 1:
            raise ConfigError(f"pipeline.virtual_stages={self.virtual_stages} must be >= 1")
        if self.partition not in ("uniform", "parameters", "compute") and not self.partition.startswith("type:"):
            raise ConfigError(
                f"pipeline.partition={self.partition!r}: use 'uniform', 'parameters', 'compute' or "
                "'type:<regex on class names>'"
            )
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ConfigError(
                f"pipeline.virtual_stages={self.virtual_stages} needs pipeline.schedule='interleaved_1f1b'"
            )
        return self


@dataclass(frozen=True, kw_only=True)
class TensorParallelConfig:
    """plan: {pattern: style} over the built-in plan. sequence_parallel: split activations between layers along
    the sequence. overlap_chunks: each row-parallel layer's forward in this many row chunks, chunk i's all-reduce
    in flight during chunk i+1's matmul (lightning_scale.tensor_parallel.overlap; 1: off). expert_parallel: the
    mixture-of-experts layers' experts placed whole on the tp ranks (E / tp each) instead of every expert split
    (lightning_scale.tensor_parallel.expert_parallel)."""

    plan: Optional[Dict[str, str]] = None
    sequence_parallel: bool = False
    overlap_chunks: int = 1
    expert_parallel: bool = False

    def validate(self, tp: int) -> "TensorParallelConfig":
        if not isinstance(self.expert_parallel, bool):
            raise ConfigError(f"tensor.expert_parallel={self.expert_parallel!r} must be True or False")
        if self.expert_parallel and tp == 1:
            raise ConfigError("tensor.expert_parallel=True needs tp > 1 (the experts are placed on the tp ranks)",
                              settings=("tp",))
        if self.sequence_parallel and tp == 1:
            raise ConfigError("tensor.sequence_parallel=True needs tp > 1", settings=("tp",))
        n = self.overlap_chunks
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"tensor.overlap_chunks={n!r} must be an integer >= 1 (1: no overlap)")
        if n > 1 and tp == 1:
            raise ConfigError(f"tensor.overlap_chunks={n} needs tp > 1", settings=("tp",))
        if n > 1 and self.sequence_parallel:
            raise ConfigError(f"tensor.overlap_chunks={n} with tensor.sequence_parallel=True: the overlap splits the "
                              "row-parallel all-reduce, which sequence parallelism replaces by a reduce-scatter; "
                              "use one of the two")
        return self


# ---- diagnostics (issue 15): what happens when a run goes wrong (docs/failures.md)
ON_NONFINITE = ("skip", "raise", "ignore")


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value < 0 if allow_zero else value <= 0):
        raise ConfigError(f"diagnostics.{name}={value!r} must be a finite number {'>= 0' if allow_zero else '> 0'}")


def _count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"diagnostics.{name}={value!r} must be an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class DiagnosticsConfig:
    """What happens when a run goes wrong (see docs/failures.md).

    watchdog: heartbeats through the c10d store (not the training process group).
    hang_timeout: seconds a rank may wait inside one collective before every rank prints the diagnosis and exits.
    first_step_grace: extra seconds allowed until the first optimizer step (compile, warm-up, first gather).
    heartbeat_interval: seconds between heartbeats / checks of the store by the monitor thread.
    debug_collectives: fingerprint every collective (op, bytes, per-group sequence number) and compare it
        across the group; also turned on by ``LIGHTNING_SCALE_DEBUG_COLLECTIVES=1``. Slow: debugging only.
    stop_timeout: seconds from a SIGTERM/SIGINT (or a peer's failure) until a rank that has not stopped
        cleanly is ended anyway.
    save_on_preempt: on SIGTERM/SIGINT, write a checkpoint at the step where every rank stops.
    on_nonfinite: a non-finite loss or gradient norm: "skip" the step (logged), "raise" at once, or "ignore".
    max_nonfinite_steps: this many skipped steps in a row (non-finite, or fp16 overflow) stop the run.
    max_min_scale_steps: fp16: this many steps in a row at the minimum loss scale stop the run.
    """

    watchdog: bool = True
    hang_timeout: float = 300.0
    first_step_grace: float = 300.0
    heartbeat_interval: float = 2.0
    debug_collectives: bool = False
    stop_timeout: float = 25.0
    save_on_preempt: bool = False
    on_nonfinite: str = "skip"
    max_nonfinite_steps: int = 10
    max_min_scale_steps: int = 20

    def validate(self) -> "DiagnosticsConfig":
        for name in ("watchdog", "debug_collectives", "save_on_preempt"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"diagnostics.{name}={getattr(self, name)!r} must be True or False")
        _positive("hang_timeout", self.hang_timeout)
        _positive("first_step_grace", self.first_step_grace, allow_zero=True)
        _positive("heartbeat_interval", self.heartbeat_interval)
        if self.heartbeat_interval > self.hang_timeout:
            raise ConfigError(f"diagnostics.heartbeat_interval={self.heartbeat_interval} must be <= "
                              f"diagnostics.hang_timeout={self.hang_timeout}")
        _positive("stop_timeout", self.stop_timeout)
        if self.on_nonfinite not in ON_NONFINITE:
            raise ConfigError(f"diagnostics.on_nonfinite={self.on_nonfinite!r}: must be one of "
                              f"{', '.join(ON_NONFINITE)}")
        _count("max_nonfinite_steps", self.max_nonfinite_steps)
        _count("max_min_scale_steps", self.max_min_scale_steps)
        return self


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Everything Zero3DStrategy needs to know about the layout, validated as a whole."""

    dp: Optional[int] = None  # None: world_size / (pp * tp * sp)
    tp: int = 1
    pp: int = 1
    # Ulysses sequence parallelism (lightning_scale.sequence_parallel; docs/long_sequences.md): each of sp ranks holds
    # 1/sp of every sequence; attention all-to-alls to heads/sp over the full sequence. ZeRO shards over dp x sp.
    sp: int = 1
    # Expert parallelism over data-parallel ranks (lightning_scale.tensor_parallel.expert_alltoall, docs/tensor_parallel
    # .md): each of ep ranks reads its own batch and holds E / ep whole experts of every mixture-of-experts layer;
    # routes travel by all-to-all. The grid carries it on the tp axis (tp must be 1): data-parallel ranks = dp x ep.
    ep: int = 1
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tensor: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    # configure_model on the meta device where the layout materializes only local pieces (zero.stage=3, tp > 1,
    # pp > 1). False: configure_model builds real weights (e.g. it loads pretrained ones), rank 0's are broadcast.
    meta_init: bool = True
    # How save_checkpoint writes: "sharded" (per-rank files, resumes on the same layout only) or "universal"
    # (layout-free, torch.distributed.checkpoint: resumes on any dp / stage; docs/checkpoints.md). Loading detects it.
    checkpoint_format: str = "sharded"
    # checkpoint_format="universal" only: save_checkpoint returns after a host snapshot of the state and a thread
    # writes it (lightning_scale.checkpoint.async_save; one save in flight, waited for at the next save / teardown).
    # "overlap": the engines' shards, masters and optimizer state are copied by that thread during the next forward /
    # backward, and the next optimizer step waits for the copy (a callback that edits weights between steps must
    # call strategy.wait_checkpoint_snapshot() first).
    checkpoint_async: Any = False
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    # Activation checkpointing per unit (lightning_scale.activation_checkpointing; docs/long_sequences.md): None,
    # "full" (keep only each unit's input, recompute it in backward) or "selective" (also keep matmul and attention
    # outputs). Units: class names or name patterns as zero.unit_modules; None = every repeated block.
    activation_checkpointing: Optional[str] = None
    activation_checkpointing_units: Optional[tuple] = None
    # The checkpointed units' inputs wait in (pinned) host memory between forward and backward, fetched back one
    # unit ahead (lightning_scale.activation_offload). Needs activation_checkpointing; nothing to move on a CPU.
    offload_activations: bool = False
    # Tiled MLP (lightning_scale.tiled_mlp, ALST's TiledMLP): each unit's MLP runs tiled_mlp positions at a time and
    # recomputes tile by tile in backward, so its 4d-wide activations exist for one tile. 0: off. Modules: class
    # names or name patterns; None = the child named mlp (feed_forward, ffn) of every repeated block.
    tiled_mlp: int = 0
    tiled_mlp_modules: Optional[tuple] = None
    # Head-tiled attention (lightning_scale.tiled_attention): each unit's attention runs and recomputes tiled_attention
    # heads at a time, so its q / k / v, output and their gradients exist for one group of heads. 0: off. The project
    # GPT's attention and Hugging Face attentions with q/k/v/o_proj Linear layers; not with tp > 1.
    tiled_attention: int = 0
    # torch.compile per unit (lightning_scale.compile; the units are zero.unit_modules' or every repeated block):
    # False, True (torch.compile's defaults: inductor) or a dict of torch.compile options ({"backend": "aot_eager"}).
    compile: Any = False

    def _check_fullgraph(self) -> None:
        """``compile={"fullgraph": True}`` needs units without graph breaks: what puts deliberate ones inside every unit
        (eager collectives and tiled regions) is named here, before training, not by Dynamo's "Unsupported: Skip calling
        torch.compiler.disable()d function" at the first step."""
        if not (isinstance(self.compile, Mapping) and self.compile.get("fullgraph")):
            return
        inside = (("tp", self.tp, self.tp > 1, "the parallel layers and their collectives"),
                  ("sp", self.sp, self.sp > 1, "the Ulysses all-to-alls of every attention"),
                  ("tiled_mlp", self.tiled_mlp, bool(self.tiled_mlp), "the tiled MLP, an eager region"),
                  ("tiled_attention", self.tiled_attention, bool(self.tiled_attention),
                   "the head-tiled attention, an eager region"))
        for name, value, on, what in inside:
            if on:
                raise ConfigError(f"compile.fullgraph=True with {name}={value}: it puts deliberate graph breaks inside "
                                  f"every unit ({what}), which fullgraph forbids; leave fullgraph off (the units then "
                                  "compile in a few graphs each)", settings=("compile", name))

    def validate(self, world_size: Optional[int] = None) -> "ParallelConfig":
        for name in ("tp", "pp", "sp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ConfigError(f"dp={self.dp!r} must be a positive integer")
        self.zero.validate()
        self.offload.validate(self.zero.stage)
        self.pipeline.validate(self.pp)
        self.tensor.validate(self.tp)
        self.loss_scale.validate()
        self.diagnostics.validate()
        if not isinstance(self.meta_init, bool):
            raise ConfigError(f"meta_init={self.meta_init!r} must be True or False")
        _check_choice("checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        if not (isinstance(self.checkpoint_async, bool) or self.checkpoint_async == "overlap"):
            raise ConfigError(f"checkpoint_async={self.checkpoint_async!r} must be True, False or 'overlap'")
        if self.checkpoint_async and self.checkpoint_format != "universal":
            raise ConfigError(f"checkpoint_async={self.checkpoint_async!r} needs checkpoint_format='universal' (got "
                              f"checkpoint_format={self.checkpoint_format!r}): asynchronous saves write the "
                              "layout-free format",
                              settings=("checkpoint_format", "checkpoint_async"))
        if self.activation_checkpointing is not None:
            if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
                raise ConfigError(f"activation_checkpointing={self.activation_checkpointing!r}: must be 'full', "
                                  "'selective' or None (off)")
        units = self.activation_checkpointing_units
        if units is not None and (isinstance(units, str) or not all(isinstance(u, str) and u for u in units)):
            raise ConfigError(f"activation_checkpointing_units={units!r} must be a list of module class names or "
                              "name patterns")
        if not isinstance(self.offload_activations, bool):
            raise ConfigError(f"offload_activations={self.offload_activations!r} must be True or False")
        if self.offload_activations and self.activation_checkpointing is None:
            raise ConfigError("offload_activations=True needs activation_checkpointing='full' or 'selective' (the "
                              "offloaded tensors are the checkpointed units' inputs)",
                              settings=("activation_checkpointing",))
        if units and self.activation_checkpointing is None:
            raise ConfigError(f"activation_checkpointing_units={tuple(units)!r} needs activation_checkpointing="
                              "'full' or 'selective'", settings=("activation_checkpointing",))
        if not isinstance(self.tiled_mlp, int) or isinstance(self.tiled_mlp, bool) or self.tiled_mlp < 0:
            raise ConfigError(f"tiled_mlp={self.tiled_mlp!r} must be a number of positions per tile (0: off)")
        mlps = self.tiled_mlp_modules
        if mlps is not None and (isinstance(mlps, str) or not all(isinstance(u, str) and u for u in mlps)):
            raise ConfigError(f"tiled_mlp_modules={mlps!r} must be a list of module class names or name patterns")
        if mlps and not self.tiled_mlp:
            raise ConfigError(f"tiled_mlp_modules={tuple(mlps)!r} needs tiled_mlp=N (positions per tile)",
                              settings=("tiled_mlp",))
        if self.tiled_mlp and self.tp > 1 and self.tensor.sequence_parallel:
            raise ConfigError(f"tiled_mlp={self.tiled_mlp} with tensor.sequence_parallel=True: the MLP's row-parallel "
                              "output is reduce-scattered over the sequence, per tile, which would interleave the "
                              "ranks' positions; use one of them", settings=("tiled_mlp", "sequence_parallel"))
        ta = self.tiled_attention
        if not isinstance(ta, int) or isinstance(ta, bool) or ta < 0:
            raise ConfigError(f"tiled_attention={ta!r} must be a number of heads per group (0: off)")
        if ta and self.tp > 1:
            raise ConfigError(f"tiled_attention={ta} with tp={self.tp}: head tiling slices the plain qkv projection "
                              "and would skip tensor parallelism's collectives; use one of them",
                              settings=("tiled_attention", "tp"))
        _check_compile(self.compile)
        self._check_fullgraph()
        self._check_ep()
        if world_size is not None:
            spx = f" x sp={self.sp}" if self.sp > 1 else ""
            epx = f" x ep={self.ep}" if self.ep > 1 else ""
            if world_size % (self.tp_axis * self.pp * self.sp):
                raise ConfigError(
                    f"tp={self.tp}{epx} x pp={self.pp}{spx} does not divide the world size {world_size} (devices x "
                    "nodes)")
            dp = self.resolved_dp(world_size)
            if dp * self.tp_axis * self.pp * self.sp != world_size:
                raise ConfigError(
                    f"dp={dp} x tp={self.tp}{epx} x pp={self.pp}{spx} = {dp * self.tp_axis * self.pp * self.sp} does "
                    f"not equal the world size {world_size} (devices x nodes)"
                )
        return self

    def _check_ep(self) -> None:
        """What expert parallelism over data-parallel ranks composes with today (each named before training)."""
        if self.ep == 1:
            return
        if self.tensor.expert_parallel:
            raise ConfigError(f"ep={self.ep} with tensor.expert_parallel=True: the experts are placed on the ep ranks "
                              "already (expert_parallel places them on tp ranks); use one of them",
                              settings=("ep", "tensor.expert_parallel"))
        if self.tp > 1:  # the grid carries ep on its tp axis
            raise ConfigError(f"ep={self.ep} with tp={self.tp}: expert parallelism over data-parallel ranks does not "
                              "compose with tensor parallelism yet (expert_parallel=True places the experts on the tp "
                              "ranks instead); use one of them", settings=("ep", "tp"))

    @property
    def partial_grads(self) -> bool:
        """Whether whole parameters get per-rank partial gradients summed over the tp axis before the dp reduction
        (tensor.sequence_parallel, or ep > 1): the engines then reduce at the step, not during the backward."""
        return bool(self.tensor.sequence_parallel) or self.ep > 1

    @property
    def tp_axis(self) -> int:
        """The grid's tp axis: tensor-parallel ranks, or (``ep > 1``) the expert-parallel ranks it carries."""
        return self.tp * self.ep

    def resolved_dp(self, world_size: int) -> int:
        """The ZeRO axis (each parameter sharded / replicated over it); with ``ep > 1`` the data-parallel ranks are
        ``dp x ep``."""
        return self.dp if self.dp is not None else max(1, world_size // (self.tp_axis * self.pp * self.sp))


# The flat schema and the user's words live in lightning_scale.config_flat; callers import them from here.
from lightning_scale.config_flat import (  # noqa: E402,F401
    _FLAT_OF,
    COMPOSITES,
    FLAT,
    FLAT_NAMES,
    HYDRA,
    ONEBIT_NAMES,
    PRESETS,
    RESERVED,
    SCHEMA,
    TRAINER_FLAGS,
    FlatKey,
    _offload_from,
    _rename,
    check_trainer_flags,
    config_from_flat,
    flat_name,
    flat_schema,
    from_flat_kwargs,
    hydra_key,
    sections,
    speaking,
)
