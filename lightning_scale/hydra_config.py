"""Hydra structured configs (registered in the ConfigStore) and the builder the example uses.

Only ``examples/`` and this module import Hydra. Every group in ``conf/`` is typed by a dataclass here,
so a misspelled key fails with Hydra's own error (``Key 'stgae' not in 'StrategyConf'``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


@dataclass
class StrategyConf:
    name: str = "zero3d"  # "zero3d" options below; or any Lightning strategy name ("ddp", "auto")
    stage: int = 2
    dp: Optional[int] = None
    tp: int = 1
    pp: int = 1
    bucket_mb: float = 25.0
    overlap_comm: bool = True
    offload: str = "none"  # none | optimizer | params | all  (params: stage 3 only)
    prefetch_depth: int = 1  # stage 3: units all-gathered ahead of use
    persistent_threshold: int = 0  # stage 3: parameters smaller than this stay gathered
    unit_modules: Optional[List[str]] = None  # stage 3: class names / name patterns; null = repeated blocks
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    partition: str = "parameters"  # pipeline: parameters | compute | uniform | type:<regex>
    sequence_parallel: bool = False
    plan: Any = None  # tensor parallel: {pattern: style}; null = built-in plan
    meta_init: bool = True  # stage 3 / tp / pp: configure_model on meta; false: real weights, rank 0's broadcast


@dataclass
class ModelConf:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = False


@dataclass
class DataConf:
    source: str = "stdlib"  # the Python standard library's sources (offline everywhere), or "random"
    batch_size: int = 8  # per data-parallel rank
    max_bytes: int = 4 * 2**20
    val_fraction: float = 0.05
    num_workers: int = 0


@dataclass
class OptimizerConf:
    name: str = "adamw"  # adamw | onebit_adam | sgd
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    freeze_step: Optional[int] = None  # OneBitAdam: warm-up steps before compression


@dataclass
class TrainerConf:
    accelerator: str = "auto"
    devices: Any = "auto"  # "auto": every GPU, or 2 CPU processes when there is none
    num_nodes: int = 1
    max_steps: int = 300
    max_time: Optional[str] = None  # "DD:HH:MM:SS"
    val_check_interval: int = 100
    limit_val_batches: int = 16
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    default_root_dir: str = "."


@dataclass
class TrainConfig:
    strategy: StrategyConf = field(default_factory=StrategyConf)
    model: ModelConf = field(default_factory=ModelConf)
    data: DataConf = field(default_factory=DataConf)
    optimizer: OptimizerConf = field(default_factory=OptimizerConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    attention: Optional[Any] = None  # a lightning_scale.nn sparsity config (_target_), or null for dense
    precision: str = "32-true"
    seed: int = 0
    ckpt_path: Optional[str] = None


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=TrainConfig)
    for group, node in (("strategy", StrategyConf), ("model", ModelConf), ("data", DataConf),
                        ("optimizer", OptimizerConf), ("trainer", TrainerConf)):
        cs.store(group=group, name=f"base_{group}", node=node)


def resolve_devices(accelerator: str, devices: Any):
    """"auto" means every GPU when there is one, else 2 CPU processes (the main job's promise)."""
    if devices != "auto":
        return accelerator, devices
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "gpu", torch.cuda.device_count()
    return "cpu", 2


def build_strategy(cfg: StrategyConf):
    if cfg.name not in ("zero3d", "zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"):
        return cfg.name  # a Lightning strategy by name
    from lightning_scale import Zero3DStrategy

    options = {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "name"} if isinstance(cfg, DictConfig) \
        else {k: getattr(cfg, k) for k in StrategyConf.__dataclass_fields__ if k != "name"}
    if options.get("unit_modules") is not None:
        options["unit_modules"] = tuple(options["unit_modules"])
    return Zero3DStrategy(**options)
