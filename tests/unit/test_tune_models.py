"""The autotuner beyond the package GPT (issue 17 item 4): a LightningModule holding a Hugging Face Llama is counted
(heads, key/value heads, layers, embeddings from its config; the decoder layers as units), compile rows are searched
with --compile, the one-memory prediction (what a CPU probe measures) counts offloaded states once; bad modules are
ConfigErrors naming --module."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

from lightning_scale.config import ConfigError
from lightning_scale.estimate import _model_from_spec, estimate, model_counts
from lightning_scale.tune import Candidate, Shape, build_module, find_model, main, one_memory_bytes, plan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "strategies"))

LLAMA = "tune_llama_module:TinyLlama"


def test_hf_llama_module_is_counted_from_its_config():
    lm = build_module(LLAMA, meta=True)
    model, shape = find_model(lm)
    assert type(model).__name__ == "LlamaForCausalLM" and isinstance(shape, Shape)
    assert (shape.n_head, shape.n_kv_head, shape.n_layer, shape.vocab_size) == (4, 2, 4, 2048)
    assert shape.embed_params == shape.head_params == 2048 * 128  # untied head
    counts = model_counts(model)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert counts["largest_unit_params"] == layer  # the decoder layer, not LlamaModel
    rows = plan(model, dataclasses.replace(shape, seq_len=32), 4, 8, 1e12, stages=(1,), acs=(None,), buckets=(25,))
    why = {r.candidate.tp: r.reason for r in rows if r.reason}
    assert "tp=4 does not divide the 2 key/value heads" in why[4]
    assert any(not r.reason and r.candidate.tp == 2 for r in rows)


def test_hf_llama_relief_and_sp():
    """A Hugging Face Llama: its MLP tiles and its attention head-tiles (q/k/v/o_proj; groups of whole key/value
    heads, 2 query heads each), under sp too; sp needs its key/value heads to split."""
    from lightning_scale.tune import relief_ladder, relief_support

    model, shape = find_model(build_module(LLAMA, meta=True))
    assert relief_support(model) == (True, True, 2)
    shape = dataclasses.replace(shape, seq_len=1024)
    base = Candidate(stage=2, offload="none", dp=2, ac="full")
    assert [c.relief for c in relief_ladder(model, shape, base)] == ["", "/tmlp256", "/tmlp256/theads1",
                                                                      "/tmlp256/theads1/actoff"]
    sp = dataclasses.replace(base, dp=1, sp=2)
    assert [c.relief for c in relief_ladder(model, shape, sp)] == ["", "/tmlp128", "/tmlp128/theads2",
                                                                    "/tmlp128/theads2/actoff"]
    assert relief_ladder(model, shape, dataclasses.replace(base, dp=1, sp=4))[2].tiled_attention == 4
    rows = plan(model, shape, 4, 4, 1e12, stages=(2,), acs=(None,), buckets=(25,), tps=(1,), pps=(1,), sps=(2, 4))
    why = {r.candidate.sp: r.reason for r in rows if r.reason}
    assert "sp=4 does not divide the 2 key/value heads per tp rank" in why[4]
    assert any(not r.reason and r.candidate.sp == 2 for r in rows)
    c = dataclasses.replace(sp, tiled_mlp=128, act_offload=True)
    assert c.strategy_kwargs() == dict(stage=2, offload="none", tp=1, pp=1, bucket_mb=25.0,
                                       activation_checkpointing="full", compile=False, sp=2, tiled_mlp=128,
                                       offload_activations=True)


def test_module_without_a_countable_model_is_a_config_error_naming_module(capsys):
    assert main(["--module", "torch.nn:Identity", "--estimate-only"]) == 2
    err = capsys.readouterr().err
    assert "--module" in err and "Identity" in err
    assert main(["--module", "no_such_module_x:Thing", "--estimate-only"]) == 2
    assert "--module='no_such_module_x:Thing'" in capsys.readouterr().err


def test_module_estimate_only_prints_the_strategy_winner(capsys):
    rc = main(["--module", LLAMA, "--devices", "2", "--global-batch", "4", "--seq-len", "32", "--memory-budget",
               "1GiB", "--estimate-only"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "winner: Zero3DStrategy(stage=" in out and "on 2 devices" in out


def test_compile_rows_are_searched_only_with_compile():
    model = _model_from_spec("gpt_small")
    space = dict(stages=(2,), offloads=("none",), tps=(1,), pps=(1,), acs=(None,), buckets=(25,),
                 compile_options=(False, True))
    off = plan(model, model.cfg, 2, 4, 1e12, **space)
    assert all(r.reason.startswith("compile:") for r in off if r.candidate.compile)
    on = plan(model, model.cfg, 2, 4, 1e12, allow_compile=True, **space)
    fit = [r.candidate for r in on if not r.reason]
    assert any(c.compile for c in fit) and any(not c.compile for c in fit)
    assert all("strategy.compile=true" in c.overrides() for c in fit if c.compile)


@pytest.mark.parametrize("stage,offload", [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "all")])
def test_one_memory_counts_offloaded_states_once(stage, offload):
    """On a CPU the fp32 host master / gradient copies are the device shard (aliases): the one-memory prediction of
    an offloaded layout equals the same stage's without offload minus the kept gradient buffer (stages 1-2) or the
    step scratch on the device (stage 3); at bf16-mixed the host's fp32 copies are real and add."""
    kw = dict(dp=2, stage=stage, precision="32-true", largest_unit_params=1e5, optimizer="adamw")
    on, off = estimate(1e6, offload=offload, **kw), estimate(1e6, offload="none", **kw)
    assert one_memory_bytes(on) <= one_memory_bytes(off)
    resident = 1e6 * 4 / (2 if stage == 3 else 1) + 2 * 1e6 * 4 / 2  # params (stage 3: the shard) + Adam's moments
    assert one_memory_bytes(on) >= resident
    mixed = dict(kw, precision="bf16-mixed")
    assert one_memory_bytes(estimate(1e6, offload=offload, **mixed)) > one_memory_bytes(on) * 0.5


def test_repeated_blocks_with_unknown_heads_plan_without_tp_or_sp():
    """A model of repeated blocks whose head count is unknown (no GPT, no HF config): dp layouts are planned, tp and
    sp splits rejected with the reason (the plan once raised TypeError on ``None % tp`` here, at tp=1 too)."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(32), nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.blocks, self.head = nn.Embedding(100, 32), nn.ModuleList(Block() for _ in range(2)), \
                nn.Linear(32, 100)

    model, shape = find_model(Blocks())
    assert isinstance(shape, Shape) and shape.n_head is None and shape.n_layer == 2
    rows = plan(model, dataclasses.replace(shape, seq_len=64), 2, 2, 1e12, stages=(2,), acs=(None,), buckets=(25,),
                pps=(1,), sps=(1, 2))
    assert any(not r.reason and r.candidate.split == "dp2tp1pp1" for r in rows)
    why = {r.candidate.split: r.reason for r in rows if r.reason}
    assert "the head count of Blocks is unknown" in why["dp1tp2pp1"]
    assert "sp=2: the head count of Blocks is unknown" in why["dp1tp1pp1sp2"]


def test_mixture_of_experts_tries_its_experts_placed_at_tp():
    """A Mixtral module: its expert count comes from the experts modules; every tp > 1 layout is tried with the experts
    split and placed (expert_parallel, where tp divides the 4 experts), the placed one's settings and Hydra line say
    so; the dense Llama gets no such candidate."""
    lm = build_module("tune_llama_module:TinyMixtral", meta=True)
    model, shape = find_model(lm)
    assert shape.n_experts == 4
    rows = plan(model, dataclasses.replace(shape, seq_len=32), 4, 8, 1e12, stages=(1,), acs=(None,), buckets=(25,))
    ok = [r.candidate for r in rows if not r.reason]
    assert {(c.tp, c.expert_parallel) for c in ok} >= {(1, False), (2, False), (2, True)}
    assert not any(c.expert_parallel and c.tp == 1 for c in ok)
    placed = next(c for c in ok if c.expert_parallel)
    assert placed.strategy_kwargs()["expert_parallel"] is True and "ep" in placed.key
    assert "strategy.expert_parallel=true" in placed.overrides()
    from lightning_scale.strategies.autotune import settings

    split = next(c for c in ok if c.tp == 2 and not c.expert_parallel)
    assert settings(split)["expert_parallel"] is False  # a split winner replaces a launch-time expert_parallel=True
    # a user's Zero3DStrategy(expert_parallel=True, autotune=True): kept; tp=1 layouts rejected with the reason
    from lightning_scale.strategies.autotune import options, search_space

    space, _ = search_space(options(True), {"expert_parallel": True}, 4, shape.n_head, shape.n_layer)
    assert space["eps"] == (True,)
    rows = plan(model, dataclasses.replace(shape, seq_len=32), 4, 8, 1e12, stages=(1,), acs=(None,), buckets=(25,),
                eps=(True,))
    assert {r.candidate.expert_parallel for r in rows if not r.reason} == {True}
    assert any("expert_parallel=True: tp=1 places no experts" in r.reason for r in rows if r.candidate.tp == 1)
    llama_model, llama = find_model(build_module(LLAMA, meta=True))
    assert llama.n_experts == 0
    rows = plan(llama_model, dataclasses.replace(llama, seq_len=32), 2, 8, 1e12, stages=(1,), acs=(None,),
                buckets=(25,))
    assert not any(r.candidate.expert_parallel for r in rows)


def test_mixture_of_experts_tries_ep_over_data_parallel_ranks():
    """At tp = 1 a mixture of experts is also tried with its experts on ep data-parallel ranks (every divisor of the
    data-parallel ranks that divides the 4 experts): the ranks read dp x ep different rows, each holds E / ep experts
    (the prediction drops by the experts' share), the settings and the Hydra line carry ep. The in-Trainer
    ``autotune=True`` searches the same (a user's ``ep`` is kept; tests/strategies/test_autotune_trainer.py trains the
    winner); a dense model gets none."""
    lm = build_module("tune_llama_module:TinyMixtral", meta=True)
    model, shape = find_model(lm)
    shape = dataclasses.replace(shape, seq_len=32)
    rows = plan(model, shape, 4, 8, 1e12, stages=(1,), acs=(None,), buckets=(25,), pps=(1,))
    ok = [r for r in rows if not r.reason]
    eps = {(r.candidate.dp, r.candidate.tp, r.candidate.ep) for r in ok}
    assert {(4, 1, 1), (2, 1, 2), (1, 1, 4)} <= eps and not any(tp > 1 and ep > 1 for _, tp, ep in eps), eps
    by = {(r.candidate.ep, r.candidate.micro_batch): r for r in ok if r.candidate.tp == 1}
    ep2, ep1 = by[(2, 2)], by[(1, 2)]  # the same 2 sequences per data-parallel rank
    assert ep2.candidate.data_ranks == 4 and ep2.candidate.world == 4 and "ep2" in ep2.candidate.key
    assert ep2.candidate.strategy_kwargs()["ep"] == 2 and "strategy.ep=2" in ep2.candidate.overrides()
    assert ep2.predicted < ep1.predicted  # half the experts per rank
    from lightning_scale.tune_plan import expert_share

    assert 0.5 < expert_share(model) < 1.0  # the experts are most of this Mixtral's layers
    from lightning_scale.strategies.autotune import options, search_space

    space, _ = search_space(options(True), {}, 4, shape.n_head, shape.n_layer)
    assert space["eds"] is None  # every valid ep (tune_plan._ep_options)
    assert search_space(options(True), {"ep": 2}, 4, shape.n_head, shape.n_layer)[0]["eds"] == (2,)
    llama_model, llama = find_model(build_module(LLAMA, meta=True))
    rows = plan(llama_model, dataclasses.replace(llama, seq_len=32), 4, 8, 1e12, stages=(1,), acs=(None,),
                buckets=(25,))
    assert not any(r.candidate.ep > 1 for r in rows)
