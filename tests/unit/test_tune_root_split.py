"""The autotuner's ZeRO-3 relief rung ``split_root`` (no processes): where ZeRO-3's root unit (embeddings, head: gathered
from its first use in the forward to the end of the backward) outweighs two blocks, a layout that does not fit may
name the root's large modules as units of their own (``zero.unit_modules``), cheapest rung first; the names are those
of the module the engine shards (a LightningModule around a Hugging Face model: ``model.``); a user's own
``unit_modules`` is kept and counted. The probe's measurement of such a layout: tests/dist/test_tune_probe.py."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from lightning_scale.config import from_flat_kwargs
from lightning_scale.estimate import _model_from_spec, model_counts
from lightning_scale.tune import Candidate, check_overrides, plan, predict_bytes, relief_ladder, root_split_units

Z3 = Candidate(stage=3, offload="none", dp=2, micro_batch=1, accum=4)
SPACE = dict(stages=(3,), offloads=("none",), tps=(1,), pps=(1,), acs=(None, "full"), micro_batches=(1,))


def test_rung_names_the_embeddings_and_head_first_and_only_at_zero3_without_a_pipeline():
    model = _model_from_spec("gpt_small")
    units = ("Block", "lm_head", "wte")  # wpe (128 x 256) is under a tenth of the root: it stays there
    assert root_split_units(model) == units
    rungs = relief_ladder(model, model.cfg, Z3)
    assert rungs[1].unit_modules == units and rungs[1].relief == "/splitroot"  # the cheapest rung: no recompute
    assert all(c.unit_modules == units for c in rungs[2:])  # the later rungs keep it
    for other in (dataclasses.replace(Z3, stage=2), dataclasses.replace(Z3, dp=1, pp=2)):
        assert not any(c.unit_modules for c in relief_ladder(model, model.cfg, other)), other
    assert not relief_ladder(model, model.cfg, Z3, relief=("tiled_mlp",))[1].unit_modules
    # a tied embedding and head is one parameter two modules share: the root keeps it whatever the units
    assert root_split_units(_model_from_spec("gpt_small:tie_weights=True")) == ()
    # the counts follow the units: the root is the final norm and the position table, the head the largest unit
    counts = model_counts(model, units=units)
    assert counts["root_params"] == sum(p.numel() for m in (model.ln_f, model.wpe) for p in m.parameters())
    assert counts["largest_unit_params"] == model.lm_head.weight.numel()
    whole, split = predict_bytes(model, model.cfg, Z3)[0], predict_bytes(model, model.cfg, rungs[1])[0]
    # gathered: 2 blocks + the 4.2M-parameter root -> the 2.1M head + the last block next to it + the 33K left in the
    # root (fp32): 11 MiB less per rank
    before = model_counts(model)
    assert counts["unit_pair_params"] == model.lm_head.weight.numel() + before["largest_unit_params"]
    assert whole - split == 4 * (before["root_params"] - counts["root_params"]
                                 + before["unit_pair_params"] - counts["unit_pair_params"]), (whole, split)


def test_budget_between_picks_the_split_root_over_recompute_and_its_line_composes():
    model = _model_from_spec("gpt_small")
    whole = predict_bytes(model, model.cfg, Z3)[0]
    split = predict_bytes(model, model.cfg, dataclasses.replace(Z3, unit_modules=root_split_units(model)))[0]
    rows = plan(model, model.cfg, 2, 8, (whole + split) / 2, **SPACE)
    winner = next(r for r in rows if not r.reason)
    assert winner.candidate.unit_modules == ("Block", "lm_head", "wte") and winner.candidate.ac is None, \
        winner.candidate.key  # the split (prior x1.02) before full recompute (x1.33)
    assert any(r.candidate == Z3 and "budget" in r.reason for r in rows)  # the rung below it: rejected, with bytes
    cfg = from_flat_kwargs(**winner.candidate.strategy_kwargs())
    assert cfg.zero.unit_modules == ["Block", "lm_head", "wte"]
    line = winner.candidate.overrides()
    assert "strategy.unit_modules=[Block,lm_head,wte]" in line
    check_overrides(line, ["model=gpt_mini"])  # Hydra parses the list; the pre-training checks accept it
    # a candidate's units survive the JSON round trip of the results file (a list there)
    assert Candidate(**dict(dataclasses.asdict(winner.candidate), unit_modules=["Block", "lm_head", "wte"])) \
        == winner.candidate


@pytest.fixture
def llama_module():
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "strategies")
    sys.path.insert(0, here)
    try:
        yield "tune_llama_module:TinyLlama"
    finally:
        sys.path.remove(here)


def test_hf_model_in_a_lightning_module_gets_names_the_engine_finds(llama_module):
    """find_model returns the Llama inside the LightningModule; the rung's names carry its prefix, as
    ZeRO-3 (sharding the LightningModule) resolves them; the prediction counts them on the inner model."""
    from lightning_scale.tune import build_module, find_model
    from lightning_scale.zero.units import resolve_units

    lm = build_module(llama_module, meta=True)
    model, shape = find_model(lm)
    assert shape.unit_prefix == "model."
    units = root_split_units(model, shape.unit_prefix)
    assert units == ("LlamaDecoderLayer", "model.lm_head", "model.model.embed_tokens")
    names = [n for n, _ in resolve_units(lm, units)]  # what ZeRO-3 sharding the LightningModule resolves
    assert names == ["model.model.embed_tokens"] + [f"model.model.layers.{i}" for i in range(4)] + ["model.lm_head"]
    shape = dataclasses.replace(shape, seq_len=32)
    c = dataclasses.replace(Z3, unit_modules=units)
    local = dataclasses.replace(Z3, unit_modules=("LlamaDecoderLayer", "lm_head", "model.embed_tokens"))
    assert predict_bytes(model, shape, c, unit_prefix="model.") == predict_bytes(model, shape, local)
    rows = plan(model, shape, 2, 8, 0.0, **SPACE)  # nothing fits: every ladder climbed; the prefix is the Shape's
    assert any(r.candidate.unit_modules == units for r in rows)


def test_user_units_are_kept_and_the_rung_is_off():
    from lightning_scale.strategies.autotune import options, search_space

    space, _ = search_space(options(True), {"unit_modules": ["Block", "wte"]}, 2, 4, 2)
    assert space["fixed_relief"] == {"unit_modules": ("Block", "wte")}
    assert "split_root" not in space["relief"] and "tiled_mlp" in space["relief"]
    model = _model_from_spec("gpt_small")
    rows = plan(model, model.cfg, 2, 8, 1e15, **SPACE, fixed_relief=space["fixed_relief"])
    assert rows and all(r.candidate.unit_modules == ("Block", "wte") for r in rows)
