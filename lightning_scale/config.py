"""Configuration: frozen, keyword-only dataclasses validated before any process group or model exists.

``validate()`` rejects impossible combinations with a message naming the setting, e.g.
``"zero.stage=5: must be one of 0, 1, 2, 3"``. The Hydra structured configs in ``conf/`` mirror these.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
OFFLOAD_DEVICES = ("none", "cpu")


class ConfigError(ValueError):
    """A setting is impossible or unknown; the message names it."""


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
        if self.optimizer != "none" and stage == 0:
            raise ConfigError("offload.optimizer='cpu' needs zero.stage >= 1 (stage 0 keeps no optimizer shard)")
        if self.params != "none" and stage != 3:
            raise ConfigError(f"offload.params={self.params!r} needs zero.stage=3 (got stage {stage})")
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
    plan: Optional[Dict[str, str]] = None
    sequence_parallel: bool = False

    def validate(self, tp: int) -> "TensorParallelConfig":
        if self.sequence_parallel and tp == 1:
            raise ConfigError("tensor.sequence_parallel=True needs tp > 1")
        return self


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Everything Zero3DStrategy needs to know about the layout, validated as a whole."""

    dp: Optional[int] = None  # None: world_size / (pp * tp)
    tp: int = 1
    pp: int = 1
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tensor: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    # configure_model on the meta device where the layout materializes only local pieces (zero.stage=3, tp > 1,
    # pp > 1). False: configure_model builds real weights (e.g. it loads pretrained ones), rank 0's are broadcast.
    meta_init: bool = True

    def validate(self, world_size: Optional[int] = None) -> "ParallelConfig":
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ConfigError(f"dp={self.dp!r} must be a positive integer")
        self.zero.validate()
        self.offload.validate(self.zero.stage)
        self.pipeline.validate(self.pp)
        self.tensor.validate(self.tp)
        self.loss_scale.validate()
        if not isinstance(self.meta_init, bool):
            raise ConfigError(f"meta_init={self.meta_init!r} must be True or False")
        if world_size is not None:
            if world_size % (self.tp * self.pp):
                raise ConfigError(
                    f"tp={self.tp} x pp={self.pp} does not divide the world size {world_size} (devices x nodes)"
                )
            dp = self.resolved_dp(world_size)
            if dp * self.tp * self.pp != world_size:
                raise ConfigError(
                    f"dp={dp} x tp={self.tp} x pp={self.pp} = {dp * self.tp * self.pp} does not equal the "
                    f"world size {world_size} (devices x nodes)"
                )
        return self

    def resolved_dp(self, world_size: int) -> int:
        return self.dp if self.dp is not None else max(1, world_size // (self.tp * self.pp))


# The registered strategy names (Lightning's StrategyRegistry; Fabric's too): flat keyword arguments on top of
# ParallelConfig's defaults, and the one-line description Lightning lists.
PRESETS: Dict[str, tuple] = {
    "zero3d": ({}, "ZeRO data parallelism (stage 2 by default); tp/pp/offload by options"),
    "zero0": ({"stage": 0}, "ZeRO stage 0: bucketed all-reduce overlapped with backward (DDP)"),
    "zero1": ({"stage": 1}, "ZeRO stage 1: optimizer state and fp32 master weights sharded"),
    "zero2": ({"stage": 2}, "ZeRO stage 2: stage 1 + gradients reduce-scattered during backward"),
    "zero3": ({"stage": 3}, "ZeRO stage 3: stage 2 + parameters sharded, gathered per unit just in time"),
    "zero2_offload": ({"stage": 2, "offload": "optimizer"},
                      "ZeRO-Offload: stage 2 with fp32 masters, optimizer state and step on the CPU"),
    "zero3_offload": ({"stage": 3, "offload": "all"},
                      "ZeRO-Offload stage 3: optimizer on the CPU and parameter shards resting on the CPU"),
}


def from_flat_kwargs(**kwargs: Any) -> ParallelConfig:
    """Build a ParallelConfig from Zero3DStrategy-style flat keyword arguments.

    ``stage``, ``bucket_mb``, ``prefetch_depth`` go to ``zero``; ``microbatches``, ``schedule`` to
    ``pipeline``; ``offload="optimizer" | "params" | "all"`` or an OffloadConfig; unknown names raise.
    """
    sections = {
        "zero": ZeroConfig,
        "pipeline": PipelineConfig,
        "tensor": TensorParallelConfig,
        "loss_scale": LossScaleConfig,
    }
    owners = {f.name: sec for sec, cls in sections.items() for f in fields(cls)}
    top = {f.name for f in fields(ParallelConfig)}
    nested: Dict[str, Dict[str, Any]] = {sec: {} for sec in sections}
    flat: Dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "offload":
            flat["offload"] = _offload_from(value)
        elif key == "sequence_parallel":
            nested["tensor"]["sequence_parallel"] = value
        elif key in top:
            flat[key] = value
        elif key in owners:
            nested[owners[key]][key] = value
        else:
            known = sorted(top | set(owners) | {"offload"})
            raise ConfigError(f"unknown option {key!r}; known options: {', '.join(known)}")
    for sec, cls in sections.items():
        if nested[sec]:
            if sec in flat:
                raise ConfigError(f"pass either {sec}=... or its fields, not both")
            flat[sec] = cls(**nested[sec])
    return ParallelConfig(**flat)


def _offload_from(value: Any) -> OffloadConfig:
    if isinstance(value, OffloadConfig):
        return value
    if value in (None, False, "none"):
        return OffloadConfig()
    if value == "optimizer":
        return OffloadConfig(optimizer="cpu")
    if value == "params":
        return OffloadConfig(params="cpu")
    if value in ("all", True):
        return OffloadConfig(optimizer="cpu", params="cpu")
    if isinstance(value, dict):
        return OffloadConfig(**value)
    raise ConfigError(f"offload={value!r}: use 'none', 'optimizer', 'params', 'all' or an OffloadConfig")
