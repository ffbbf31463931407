"""One schema (issue 12, point 4): ParallelConfig is the source of the flat kwargs, the Hydra strategy node and the
presets; GPTConfig is the source of the Hydra model node. Errors name the setting as the user typed it (issue 18)."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from lightning_scale.config import (
    FLAT,
    PRESETS,
    RESERVED,
    SCHEMA,
    ConfigError,
    ParallelConfig,
    check_trainer_flags,
    config_from_flat,
    flat_schema,
    from_flat_kwargs,
    sections,
    speaking,
)
from lightning_scale.hydra_config import (
    ModelConf,
    StrategyConf,
    build_strategy,
    check_before_training,
    register_configs,
    strategy_kwargs,
)
from lightning_scale.models.gpt import GPTConfig

CONF = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "conf"))
INTERNAL = re.compile(r"(?<![\w.])(zero|pipeline|tensor|loss_scale|offload|sparsity_config)\.\w+")

# A valid non-default value for every flat key, and what it sets (path -> value). A new ParallelConfig field
# must be added here: test_every_field_is_reachable_from_kwargs_and_hydra fails until it is.
VALUES = {
    "dp": 2, "tp": 2, "pp": 2, "sp": 2, "ep": 2, "stage": 3, "bucket_mb": 5.0, "overlap_comm": False, "prefetch_depth": 2,
    "persistent_threshold": 100, "unit_modules": ("Block",), "pin_memory": False, "microbatches": 4,
    "schedule": "gpipe", "virtual_stages": 2, "partition": "uniform", "plan": {"lm_head": "colwise_gather"},
    "sequence_parallel": True, "overlap_chunks": 2, "expert_parallel": True, "initial_scale": 1024.0, "growth_factor": 4.0,
    "backoff_factor": 0.25, "growth_interval": 10, "min_scale": 2.0, "hysteresis": 2, "meta_init": False,
    "offload": "all", "checkpoint_format": "universal", "checkpoint_async": True,
    "activation_checkpointing": "selective", "activation_checkpointing_units": ("Block",), "offload_activations": True,
    "compile": {"backend": "aot_eager"}, "tiled_mlp": 64, "tiled_mlp_modules": ("MLP",), "tiled_attention": 2,
    # diagnostics (docs/failures.md)
    "watchdog": False, "hang_timeout": 60.0, "first_step_grace": 30.0, "heartbeat_interval": 1.0,
    "debug_collectives": True, "stop_timeout": 10.0, "save_on_preempt": True, "on_nonfinite": "raise",
    "max_nonfinite_steps": 3, "max_min_scale_steps": 5,
}
EXPECTED = {path: VALUES[flat] for flat, key in SCHEMA.items() for path in key.paths if flat != "offload"}
EXPECTED |= {"offload.optimizer": "cpu", "offload.params": "cpu"}


def _leaf_paths(root=ParallelConfig):
    secs = sections(root)
    for f in dataclasses.fields(root):
        if f.name in secs:
            yield from (f"{f.name}.{sf.name}" for sf in dataclasses.fields(secs[f.name]))
        else:
            yield f.name


def _get(config, path):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _hydra_literal(value):
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ",".join(value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


@pytest.fixture(scope="module")
def hydra():
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        yield lambda *overrides: compose(config_name="config", overrides=["trainer=smoke", *overrides])


def test_every_field_is_reachable_from_kwargs_and_hydra(hydra):
    leaves = list(_leaf_paths())
    assert sorted(leaves) == sorted(EXPECTED), "VALUES must name a value for every ParallelConfig field"
    assert set(VALUES) == set(SCHEMA)
    for path in leaves:  # every value really differs from the default, so reaching it is visible
        assert _get(ParallelConfig(), path) != EXPECTED[path], path
    from_kwargs = config_from_flat(VALUES)
    cfg = hydra("strategy=zero3d", *(f"strategy.{k}={_hydra_literal(v)}" for k, v in VALUES.items()))
    from_hydra = config_from_flat(strategy_kwargs(cfg.strategy))
    for path in leaves:
        assert _get(from_kwargs, path) == EXPECTED[path], path
        assert _get(from_hydra, path) == EXPECTED[path], path
    assert from_hydra == from_kwargs


def test_hydra_nodes_are_generated_from_the_schemas():
    conf = {f.name: f for f in dataclasses.fields(StrategyConf)}
    assert set(conf) == set(SCHEMA) | {"name", "precision", "autotune"}  # autotune: the strategy's, not the schema's
    for flat, key in SCHEMA.items():
        assert conf[flat].default == key.default, flat
    gpt = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    assert {f.name: f.default for f in dataclasses.fields(ModelConf)} == gpt


def test_a_misspelled_key_fails_in_both_doors(hydra):
    with pytest.raises(ConfigCompositionException, match="strategy.stgae"):
        hydra("strategy.stgae=1")
    with pytest.raises(ConfigError, match=r"^unknown option 'stgae'; known options, close matches first: stage, "):
        from_flat_kwargs(stgae=1)
    with pytest.raises(ConfigError, match=r"close matches first: microbatches, "):
        from_flat_kwargs(microbatch=4)
    from lightning_scale import Zero3DStrategy

    with pytest.raises(ConfigError, match=r"^unknown option 'stgae'"):
        Zero3DStrategy(stgae=1)


@dataclass(frozen=True)
class _A:
    size: int = 1


@dataclass(frozen=True)
class _B:
    size: int = 2


@dataclass(frozen=True)
class _Root:  # two sections sharing a field name
    a: _A = field(default_factory=_A)
    b: _B = field(default_factory=_B)


def test_no_silent_collision_of_flat_names():
    Root = _Root
    with pytest.raises(TypeError, match=r"flat name 'size' of \('b.size',\) collides with \('a.size',\)"):
        flat_schema(Root, composites={})
    keys = flat_schema(Root, renames={"b.size": "b_size"}, composites={})
    assert {k: v.paths for k, v in keys.items()} == {"size": ("a.size",), "b_size": ("b.size",)}
    # the real schema: each field is set by exactly one flat key; no key shadows a section or a front-door keyword
    paths = [p for key in SCHEMA.values() for p in key.paths]
    assert sorted(paths) == sorted(_leaf_paths()) and len(paths) == len(set(paths))
    assert not (set(SCHEMA) & set(RESERVED)) and not (set(SCHEMA) & set(sections()) - {"offload"})


def test_strategy_yamls_agree_with_presets(hydra):
    stems = {f[:-5] for f in os.listdir(os.path.join(CONF, "strategy")) if f.endswith(".yaml")}
    assert set(PRESETS) <= stems
    for stem in sorted(stems):
        cfg = hydra(f"strategy={stem}")
        strategy = build_strategy(cfg.strategy)
        if stem in PRESETS:  # the yaml named after a preset is exactly that preset
            assert cfg.strategy.name == stem
            assert strategy.config == from_flat_kwargs(**PRESETS[stem][0]), stem
        elif cfg.strategy.name in PRESETS:  # tensor / pipeline / 3d: a preset plus options
            assert strategy.config == from_flat_kwargs(**{**PRESETS[cfg.strategy.name][0],
                                                          **strategy_kwargs(cfg.strategy)})
        else:
            assert strategy == cfg.strategy.name == "ddp"
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (kwargs, _) in PRESETS.items():
        assert StrategyRegistry[name]["init_params"] == kwargs


def test_option_lists_show_only_real_options(hydra):
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    for group in ("strategy", "optimizer", "model", "trainer", "attention"):
        files = sorted(f[:-5] for f in os.listdir(os.path.join(CONF, group)) if f.endswith(".yaml"))
        assert loader.get_group_options(group) == files, group


def test_unknown_strategy_name_lists_registered_names_close_first(hydra):
    with pytest.raises(ConfigError) as info:
        build_strategy(hydra("strategy.name=zer02").strategy)
    msg = str(info.value)
    assert msg.startswith("strategy.name='zer02' is not a registered strategy; registered, close matches first: "
                          "zero2, ")
    listed = msg.split(": ", 1)[1].split(", ")
    assert set(PRESETS) | {"ddp", "auto"} <= set(listed)


# (flat kwargs, Hydra overrides, what the Python door says, what the Hydra door says)
DOORS = [
    (dict(stage=5), ["strategy=zero3d", "strategy.stage=5"], "stage=5: must be", "strategy.stage=5: must be"),
    (dict(schedule="zigzag"), ["strategy.schedule=zigzag"], "schedule='zigzag'", "strategy.schedule='zigzag'"),
    (dict(stage=0, offload="optimizer"), ["strategy=zero0", "strategy.offload=optimizer"],
     "offload: optimizer offload needs stage >= 1", "strategy.offload: optimizer offload needs strategy.stage >= 1"),
    (dict(sequence_parallel=True), ["strategy.sequence_parallel=true"], "sequence_parallel=True needs tp > 1",
     "strategy.sequence_parallel=True needs strategy.tp > 1"),
    (dict(tp=2, overlap_chunks=0), ["strategy=tensor", "strategy.overlap_chunks=0"], "overlap_chunks=0 must be",
     "strategy.overlap_chunks=0 must be"),
    (dict(expert_parallel=True), ["strategy.expert_parallel=true"], "expert_parallel=True needs tp > 1",
     "strategy.expert_parallel=True needs strategy.tp > 1"),
    (dict(tp=2, ep=2), ["strategy=tensor", "strategy.ep=2"], "ep=2 with tp=2: expert parallelism over data-parallel",
     "strategy.ep=2 with strategy.tp=2: expert parallelism over data-parallel"),
    (dict(ep=0), ["strategy.ep=0"], "ep=0 must be a positive integer", "strategy.ep=0 must be a positive integer"),
]


@pytest.mark.parametrize("kwargs,overrides,python,hydra_msg", DOORS)
def test_errors_speak_the_door_the_setting_came_through(hydra, kwargs, overrides, python, hydra_msg):
    from lightning_scale import Zero3DStrategy

    with pytest.raises(ConfigError) as info:
        Zero3DStrategy(**kwargs)
    assert str(info.value).startswith(python) and not INTERNAL.search(str(info.value)), str(info.value)
    with pytest.raises(ConfigError) as info:
        check_before_training(hydra(*overrides))
    assert str(info.value).startswith(hydra_msg) and not INTERNAL.search(str(info.value)), str(info.value)


def test_world_size_and_trainer_flag_errors_name_the_key(hydra):
    with pytest.raises(ConfigError, match=r"^strategy.tp=2 x strategy.pp=2 does not divide the world size 2"):
        check_before_training(hydra("strategy=3d"))
    assert check_before_training(hydra("strategy=3d", "trainer.devices=8")).config.resolved_dp(8) == 2
    with pytest.raises(ConfigError, match=r"^trainer.gradient_clip_val=1.0: OneBitAdam with strategy.stage=2 cannot"):
        check_before_training(hydra("optimizer=onebit_adam", "strategy=zero2", "trainer.gradient_clip_val=1.0"))
    with pytest.raises(ConfigError, match=r"^gradient_clip_val=1.0: OneBitAdam with stage=1 cannot"):
        with speaking(FLAT):  # the Python door: the Trainer flag's own name
            check_trainer_flags(from_flat_kwargs(stage=1), optimizer="OneBitAdam", gradient_clip_val=1.0)


def test_onebit_adam_preset_sets_what_it_needs(hydra):
    """optimizer=onebit_adam with zero1/zero2 passes out of the box: its preset turns the default clipping off;
    at zero0 clipping stays available (each rank clips its local gradient)."""
    for stage in ("zero1", "zero2"):
        cfg = hydra("optimizer=onebit_adam", f"strategy={stage}")
        assert cfg.trainer.gradient_clip_val is None
        assert check_before_training(cfg).config.zero.stage == int(stage[-1])
    assert hydra("optimizer=adamw").trainer.gradient_clip_val == 1.0
    check_before_training(hydra("optimizer=onebit_adam", "strategy=zero0", "trainer.gradient_clip_val=1.0"))
