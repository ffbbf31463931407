"""Hydra structured configs (registered in the ConfigStore), the builder the example uses and its pre-training checks.

Only ``examples/`` and this module import Hydra. The ``strategy`` and ``model`` nodes are generated from the one
schema each (``ParallelConfig`` through ``lightning_scale.config.SCHEMA``: ``strategy.<flat name>``; ``GPTConfig``:
``model.<field>``), so a new field is a Hydra key at once, and a misspelled key fails with Hydra's own error
(``Key 'stgae' not in 'StrategyConf'``). The schemas are stored only as the root ``base_config``'s node types,
so ``strategy=`` lists real options only. Errors raised here name Hydra keys (``strategy.stage=5``).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from lightning_scale.config import (
    HYDRA,
    PRECISIONS,
    PRESETS,
    SCHEMA,
    ConfigError,
    ParallelConfig,
    check_trainer_flags,
    config_from_flat,
    speaking,
)
from lightning_scale.models.gpt_config import GPTConfig

_PRIMITIVES = (int, float, bool, str)


def _hydra_type(tp: Any) -> Any:
    """A Python annotation -> one OmegaConf can type (tuples become lists; anything else becomes Any)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        return Optional[_hydra_type(inner[0])] if len(inner) == 1 and len(args) == 2 else Any
    if tp in _PRIMITIVES:
        return tp
    if tp is tuple or tp is list or origin in (tuple, list):
        return List[Any]
    return Any  # dicts too: OmegaConf cannot merge an override into a typed Dict node that holds None


def _conf_field(default: Any) -> dataclasses.Field:
    if isinstance(default, (list, dict, tuple)):
        return field(default_factory=lambda d=default: type(default)(d))
    return field(default=default)


# strategy.<flat name> for every ParallelConfig field (SCHEMA), plus the strategy's own name and precision.
StrategyConf = dataclasses.make_dataclass("StrategyConf", [
    ("name", str, field(default="zero3d")),  # a lightning_scale preset (PRESETS) or any Lightning strategy name
    ("precision", Optional[str], field(default=None)),  # Zero3DStrategy(precision=): wins over the Trainer's flag
    ("autotune", Any, field(default=None)),  # Zero3DStrategy(autotune=): true or {budget_s: 60, memory: 2GiB, ...}
    *[(flat, _hydra_type(key.type), _conf_field(key.default)) for flat, key in SCHEMA.items()],
])

_gpt_hints = typing.get_type_hints(GPTConfig)
ModelConf = dataclasses.make_dataclass("ModelConf", [
    (f.name, _hydra_type(_gpt_hints[f.name]), _conf_field(f.default)) for f in dataclasses.fields(GPTConfig)
])
StrategyConf.__module__ = ModelConf.__module__ = __name__  # make_dataclass(module=) is Python >= 3.12


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
    # The clipping this optimizer runs with: trainer.gradient_clip_val's default. OneBitAdam's preset sets null
    # (under ZeRO 1/2 the averaged gradient it would clip never exists); trainer.gradient_clip_val=... overrides.
    gradient_clip_val: Optional[float] = 1.0


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
    gradient_clip_val: Optional[float] = "${optimizer.gradient_clip_val}"  # type: ignore[assignment]
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
    logger: Optional[Any] = None  # a Lightning logger (_target_): conf/logger/{csv,tensorboard,wandb}.yaml
    precision: str = "32-true"
    seed: int = 0
    ckpt_path: Optional[str] = None


def register_configs() -> None:
    """The root schema only: group yamls are typed through ``base_config``'s nodes (no ``base_<group>`` option)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=TrainConfig)


def resolve_devices(accelerator: str, devices: Any):
    """"auto" means every GPU when there is one, else 2 CPU processes (the main job's promise)."""
    if devices != "auto":
        return accelerator, devices
    import torch

    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "gpu", torch.cuda.device_count()
    return "cpu", 2


def strategy_names() -> List[str]:
    """Every name ``strategy.name`` takes: the lightning_scale presets and Lightning's registry, plus "auto"."""
    import lightning_scale  # noqa: F401  (registers the presets once Lightning is imported)
    from lightning.pytorch.strategies import StrategyRegistry

    return sorted(set(StrategyRegistry.available_strategies()) | set(PRESETS) | {"auto"})


def _check_name(name: str) -> None:
    names = strategy_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=4, cutoff=0.5)
        raise ConfigError(f"strategy.name={name!r} is not a registered strategy; registered, close matches first: "
                          f"{', '.join(close + [n for n in names if n not in close])}")


def strategy_kwargs(cfg: Any) -> Dict[str, Any]:
    """The strategy node -> flat keyword arguments (``SCHEMA``'s names; lists back to the schema's tuples)."""
    values = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dataclasses.asdict(cfg)
    kwargs = {k: v for k, v in values.items() if k in SCHEMA}
    for flat, key in SCHEMA.items():
        wants_tuple = key.type is tuple or tuple in typing.get_args(key.type)
        if wants_tuple and isinstance(kwargs.get(flat), list):
            kwargs[flat] = tuple(kwargs[flat])
    return kwargs


def _check_preset(name: str, kwargs: Dict[str, Any]) -> None:
    """A preset's settings and the node's values agree (strategy=zero2 strategy.stage=3 is two answers)."""
    for flat, value in PRESETS[name][0].items():
        if kwargs.get(flat) != value:
            raise ConfigError(f"strategy.name={name!r} means {flat}={value!r} but strategy.{flat}={kwargs.get(flat)!r};"
                              f" use the preset that matches, or strategy=zero3d with strategy.{flat}=...")


def _check_unused(name: str, cfg: Any) -> None:
    """A Lightning strategy by name takes none of the strategy.<option> keys: refuse them rather than drop them."""
    kwargs = strategy_kwargs(cfg)
    changed = [k for k, v in kwargs.items() if v != SCHEMA[k].default]
    precision = cfg.precision if isinstance(cfg, DictConfig) else getattr(cfg, "precision", None)
    changed += ["precision"] if precision is not None else []
    changed += ["autotune"] if (cfg.autotune if isinstance(cfg, DictConfig) else getattr(cfg, "autotune", None)) \
        not in (None, False) else []
    if changed:
        raise ConfigError(f"strategy.name={name!r} is Lightning's own strategy: strategy.{changed[0]} has no effect "
                          f"there (set: {', '.join('strategy.' + k for k in changed)}); use a lightning_scale preset "
                          f"({', '.join(PRESETS)})")


def parallel_config(cfg: Any, world_size: Optional[int] = None) -> ParallelConfig:
    """The strategy node -> a validated ParallelConfig (the same flat-kwargs path as Zero3DStrategy(**options))."""
    with speaking(HYDRA):
        return config_from_flat(strategy_kwargs(cfg)).validate(world_size)


def build_strategy(cfg: Any):
    """``cfg.strategy`` -> a Zero3DStrategy for a lightning_scale preset, else the Lightning strategy's name."""
    with speaking(HYDRA):
        name = str(cfg.name).lower()  # Lightning lower-cases strategy names too
        _check_name(name)
        if name not in PRESETS:
            _check_unused(name, cfg)
            return name
        kwargs = strategy_kwargs(cfg)
        config = config_from_flat(kwargs).validate()  # first: strategy.stage=5 is named as such, not as a preset
        _check_preset(name, kwargs)
        precision = cfg.precision
        if precision is not None and precision not in PRECISIONS:
            raise ConfigError(f"strategy.precision={precision!r}: must be one of {', '.join(PRECISIONS)} (null: the "
                              "Trainer's precision)")
        from lightning_scale import Zero3DStrategy

        autotune = cfg.autotune if not isinstance(cfg.autotune, DictConfig) else OmegaConf.to_container(cfg.autotune)
        return Zero3DStrategy(config=config, precision=precision, autotune=autotune)


def world_size(cfg: Any) -> int:
    """devices x nodes as the Trainer will see them ("auto": every GPU, else 2 CPU processes)."""
    _, devices = resolve_devices(cfg.trainer.accelerator, cfg.trainer.devices)
    count = len(devices) if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices) else int(devices)
    return count * int(cfg.trainer.num_nodes)


def check_before_training(cfg: DictConfig):
    """Everything the composed config can be refused for, before any process starts; returns the strategy
    (``build_strategy``'s answer). ConfigError names the Hydra key (``strategy.stage``, ``trainer.gradient_clip_val``).
    """
    with speaking(HYDRA):
        strategy = build_strategy(cfg.strategy)
        model = _check_model(cfg)
        if isinstance(strategy, str):
            return strategy
        config = strategy.config.validate(world_size(cfg))
        _layout_support_check()(config)
        check_trainer_flags(config, optimizer=cfg.optimizer.name, gradient_clip_val=cfg.trainer.gradient_clip_val)
        precision = cfg.strategy.precision or cfg.precision
        if precision not in PRECISIONS:
            raise ConfigError(f"precision={precision!r}: lightning_scale strategies support {', '.join(PRECISIONS)}")
        _check_layout(config, model, cfg)
        return strategy


def _check_model(cfg: DictConfig) -> GPTConfig:
    try:
        model = GPTConfig(**OmegaConf.to_container(cfg.model, resolve=True)).validate()
    except ValueError as err:  # GPTConfig names its fields model.<field>: the Hydra keys
        raise ConfigError(str(err)) from None
    if cfg.attention is not None:
        from hydra.errors import InstantiationException
        from hydra.utils import instantiate

        try:
            sparsity = instantiate(cfg.attention)  # validates itself (sparsity_config.* -> attention.*)
        except InstantiationException as err:  # Hydra wraps the target's error: the ConfigError is the news
            if isinstance(err.__cause__, ConfigError):
                raise err.__cause__ from None
            raise
        if sparsity.num_heads != model.n_head:
            raise ConfigError(f"attention.num_heads={sparsity.num_heads} but model.n_head={model.n_head}")
    return model


def _check_layout(config: ParallelConfig, model: GPTConfig, cfg: DictConfig) -> None:
    """The layout against the model and the data: tp splits whole heads, pp cuts whole layers, micro-batches
    split the per-rank batch."""
    if model.n_head % config.tp:
        raise ConfigError(f"tp={config.tp} does not divide model.n_head={model.n_head}")
    if config.ep > 1:
        raise ConfigError(f"ep={config.ep}: the project GPT has no mixture-of-experts layer (expert parallelism places "
                          "the experts of a Hugging Face mixture-of-experts model held by a LightningModule)",
                          settings=("ep",))
    if model.n_head % config.sp or model.seq_len % config.sp:  # Ulysses: heads / sp per rank, seq_len / sp positions
        what = f"model.n_head={model.n_head}" if model.n_head % config.sp else f"model.seq_len={model.seq_len}"
        raise ConfigError(f"sp={config.sp} does not divide {what}")
    if config.tp > 1 and cfg.attention is not None:
        raise ConfigError(f"tp={config.tp} with a block-sparse attention layout: not supported yet (the layout covers "
                          f"all {model.n_head} heads, each tp rank holds {model.n_head // config.tp}); use attention=dense "
                          "with tensor parallelism, or strategy tp=1", settings=("tp",))
    stages, layers = config.pp * config.pipeline.virtual_stages, model.n_layer + 2  # embedding + blocks + head
    if config.pp > 1 and stages > layers:
        raise ConfigError(f"pp={config.pp} x pipeline.virtual_stages={config.pipeline.virtual_stages} = {stages} "
                          f"stages but the model has {layers} pipeline layers (model.n_layer={model.n_layer} + 2)")
    if config.pp > 1 and cfg.data.batch_size % config.pipeline.microbatches:
        raise ConfigError(f"pipeline.microbatches={config.pipeline.microbatches} does not divide "
                          f"data.batch_size={cfg.data.batch_size} (the batch of one data-parallel rank)")


def _layout_support_check():
    """The strategy's check of what it cannot compose yet (ZeRO-3 x tp x pp, ZeRO-3 x zero-bubble)."""
    try:  # the composition core (issue 12) ...
        from lightning_scale.parallelize import check_config
    except ImportError:  # ... or the Lightning glue before it
        from lightning_scale.strategies.model_parallel import ModelParallel

        check_config = ModelParallel.check_config
    return check_config
