"""Zero3DStrategy(autotune=...) without processes (lightning_scale/strategies/autotune.py): the options, the settings
the user fixed, conflicts named by key, the Hydra key strategy.autotune."""

from __future__ import annotations

import dataclasses
import os

import pytest

from lightning_scale import Zero3DStrategy
from lightning_scale.config import ConfigError, from_flat_kwargs
from lightning_scale.models.gpt import GPT, gpt_tiny
from lightning_scale.strategies.autotune import explicit_settings, options, plan_rows, search_space, with_settings

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")


def test_options_reject_unknown_keys_and_bad_budgets():
    assert options(True)["budget_s"] == 60.0 and options({"stages": 3})["stages"] == (3,)
    with pytest.raises(ConfigError, match=r"autotune: unknown key 'memroy'; known: budget_s, memory"):
        options({"memroy": "1GiB"})
    with pytest.raises(ConfigError, match=r"autotune.budget_s=0 must be a positive number"):
        options({"budget_s": 0})
    with pytest.raises(ConfigError, match=r"autotune: unknown key 'memroy'"):  # at construction, before the launch
        Zero3DStrategy(autotune={"memroy": 1})


def test_compile_and_probe_timeout_options():
    opts = options({"compile": [False, {"backend": "aot_eager"}], "probe_timeout_s": 30})
    assert opts["compile"] == (False, {"backend": "aot_eager"}) and opts["probe_timeout_s"] == 30
    with pytest.raises(ConfigError, match=r"autotune.compile=\[True, \{'backend': 'aot_eager'\}\]: at most one"):
        options({"compile": [True, {"backend": "aot_eager"}]})
    with pytest.raises(ConfigError, match=r"autotune.compile=\[False, 'yes'\]: compile='yes' must be True"):
        options({"compile": [False, "yes"]})
    with pytest.raises(ConfigError, match=r"autotune.probe_timeout_s=0 must be a positive number"):
        options({"probe_timeout_s": 0})
    space, _ = search_space(options({"compile": [False, True]}), {}, 2, 4, 2)
    assert space["compile_options"] == (False, True)
    assert search_space(options(True), {}, 2, 4, 2)[0]["compile_options"] == (False,)  # not searched by default
    assert search_space(options(True), {"compile": True}, 2, 4, 2)[0]["compile_options"] == (True,)  # fixed
    with pytest.raises(ConfigError, match=r"autotune.compile=\[False\] excludes compile=True, set explicitly"):
        search_space(options({"compile": False}), {"compile": True}, 2, 4, 2)
    gpt = gpt_tiny(n_layer=2, vocab_size=64, seq_len=16)
    opts = options({"compile": [False, True], "stages": 2, "offloads": "none", "tp": 1, "pp": 1, "ac": "none",
                    "buckets": 25})
    rows = plan_rows(GPT(gpt), gpt, opts, {}, 2, 4, "32-true", 1e15, 1)
    assert sorted(r.candidate.key.rsplit("/", 1)[1] for r in rows if not r.reason) == ["compile", "eager"]


def test_explicit_settings_are_fixed_and_conflicts_name_the_key():
    cfg = from_flat_kwargs(stage=3, offload="optimizer")
    assert explicit_settings(cfg, ["stage", "offload", "watchdog"]) == {"stage": 3, "offload": "optimizer"}
    assert explicit_settings(from_flat_kwargs(stage=2, tp=2), None) == {"tp": 2}  # off the schema default
    space, splits = search_space(options(True), {"stage": 3}, 4, 4, 2)
    assert space["stages"] == (3,) and (4, 1, 1, 1) in splits and (1, 2, 2, 1) in splits
    with pytest.raises(ConfigError, match=r"autotune.stages=\[0, 1\] excludes stage=3, set explicitly"):
        search_space(options({"stages": [0, 1]}), {"stage": 3}, 2, 4, 2)
    with pytest.raises(ConfigError, match=r"autotune.tp=\[2\] excludes tp=1"):
        search_space(options({"tp": 2}), {"tp": 1}, 2, 4, 2)
    new = with_settings(cfg, stage=1, activation_checkpointing="full")
    assert new.zero.stage == 1 and new.offload == cfg.offload and new.activation_checkpointing == "full"


def test_plan_rows_search_only_the_free_settings():
    gpt = gpt_tiny(n_layer=2, vocab_size=64, seq_len=16)
    rows = plan_rows(GPT(gpt), gpt, options({"ac": "none"}), {"stage": 3, "pp": 1}, 2, 4, "32-true", 1e15, 1)
    keys = [r.candidate.key for r in rows if not r.reason]
    assert keys and all(k.startswith("z3/") and "pp1" in k and k.endswith("ac-none/eager") for k in keys)
    assert {"dp2tp1pp1", "dp1tp2pp1"} <= {k.split("/")[2] for k in keys}  # dp and tp splits searched
    assert all(k.split("/")[3] == "mb4x1" for k in keys)  # pp=1: the dataloader's batch is the micro-batch


def test_sp_and_memory_relief_options():
    """Ulysses is searched where ``autotune.sp`` names sizes (or ``sp`` is set); the relief ladder is on unless the
    user set one of its settings (then every layout keeps that value) or ``autotune.relief`` restricts it."""
    from lightning_scale.tune import RELIEF

    space, splits = search_space(options(True), {}, 2, 4, 2)
    assert {s[3] for s in splits} == {1} and space["relief"] == RELIEF and space["fixed_relief"] == {}
    space, splits = search_space(options({"sp": [1, 2], "relief": []}), {}, 2, 4, 2)
    assert (1, 1, 1, 2) in splits and (2, 1, 1, 1) in splits and space["relief"] == ()
    space, splits = search_space(options(True), {"sp": 2, "tiled_mlp": 256}, 2, 4, 2)
    assert splits == [(1, 1, 1, 2)] and space["relief"] == () and space["fixed_relief"] == {"tiled_mlp": 256}
    assert explicit_settings(from_flat_kwargs(sp=2, tiled_attention=1), None) == {"sp": 2, "tiled_attention": 1}
    with pytest.raises(ConfigError, match=r"autotune.sp=\[1\] excludes sp=2, set explicitly"):
        search_space(options({"sp": 1}), {"sp": 2}, 2, 4, 2)
    with pytest.raises(ConfigError, match=r"autotune.relief=\['tiled_mlp', 'tiles'\]: unknown 'tiles'"):
        options({"relief": ["tiled_mlp", "tiles"]})
    with pytest.raises(ConfigError, match=r"autotune.sp=\[0\]: sizes are positive integers"):
        options({"sp": 0})
    gpt = gpt_tiny(n_layer=2, vocab_size=64, seq_len=16)
    rows = plan_rows(GPT(gpt), gpt, options({"sp": [2], "stages": 2, "ac": "none", "buckets": 25}),
                     {"tiled_mlp": 4}, 2, 4, "32-true", 1e15, 1)
    keys = [r.candidate.key for r in rows if not r.reason]
    assert keys and all("sp2" in k and k.endswith("/tmlp4") for k in keys), keys
    from lightning_scale.strategies.autotune import settings

    # a user's offload_activations=True is kept: layouts without checkpointing are rejected with the reason
    rows = plan_rows(GPT(gpt), gpt, options({"stages": 2, "buckets": 25}), {"offload_activations": True}, 2, 4,
                     "32-true", 1e15, 1)
    assert all(r.candidate.act_offload for r in rows if not r.reason)
    assert all(r.candidate.ac for r in rows if not r.reason) and any(
        "offload_activations=True needs activation_checkpointing" in r.reason for r in rows)
    c = next(r.candidate for r in rows if not r.reason and r.candidate.sp == 1)
    c = dataclasses.replace(c, sp=2, tiled_mlp=4, act_offload=False)
    assert settings(c)["sp"] == 2 and settings(c)["tiled_mlp"] == 4 and "tiled_attention" not in settings(c)


def test_hydra_strategy_autotune_key():
    from hydra import compose, initialize_config_dir

    from lightning_scale.hydra_config import build_strategy, register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["strategy.autotune={budget_s: 30, memory: 2GiB}"])
        plain = compose(config_name="config")
        ddp = compose(config_name="config", overrides=["strategy=ddp", "strategy.autotune=true"])
    strategy = build_strategy(cfg.strategy)
    assert strategy._autotune == {"budget_s": 30, "memory": "2GiB"} and strategy._autotune_given is None
    assert build_strategy(plain.strategy)._autotune is None
    if ddp.strategy.name not in ("zero3d", "zero0", "zero1", "zero2", "zero3"):
        with pytest.raises(ConfigError, match=r"strategy.autotune has no effect"):
            build_strategy(ddp.strategy)
