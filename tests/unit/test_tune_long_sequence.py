"""The autotuner on long sequences (lightning_scale.tune, no processes): a layout that does not fit climbs the memory
relief ladder (tiled MLP, head-tiled attention, activation offload) to the first rung that fits; Ulysses (sp) splits
are searched when asked, or by the CLI when nothing fits whole sequences; bad sizes are named."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from lightning_scale.config import ConfigError
from lightning_scale.estimate import _model_from_spec
from lightning_scale.tune import (Candidate, check_overrides, enumerate_candidates, main, plan, predict_bytes,
                                  relief_ladder, relief_support)

L = 4096
SPACE = dict(tps=(1,), pps=(1,), acs=(None, "full"), stages=(2, 3))


@functools.lru_cache(maxsize=None)
def _long():
    model = _model_from_spec(f"gpt_small:seq_len={L}")
    return model, model.cfg


def test_ladder_rungs_cheapest_first_and_only_what_lowers_the_plan():
    model, gpt = _long()
    assert relief_support(model) == (True, True, 1)  # the GPT: MLP, head tiling, no GQA group
    base = Candidate(stage=2, offload="none", dp=2, ac="full")
    rungs = relief_ladder(model, gpt, base)
    assert [(c.tiled_mlp, c.tiled_attention, c.act_offload) for c in rungs] == [
        (0, 0, False), (512, 0, False), (512, 1, False), (512, 1, True)]
    # without checkpointing each rung lowers the plan: 256 -> 112 -> 48 MiB of activations kept
    plain = relief_ladder(model, gpt, dataclasses.replace(base, ac=None))
    assert not any(c.act_offload for c in plain) and len(plain) == 3  # no activation offload without checkpointing
    sizes = [predict_bytes(model, gpt, c)[0] for c in plain]
    assert all(b < a for a, b in zip(sizes, sizes[1:])), sizes
    # with full checkpointing the loss's logits hold the peak once the MLP is tiled: head tiling lowers nothing
    # there, so plan() skips that rung (its time buys no bytes) and goes on to the activation offload
    full = [predict_bytes(model, gpt, c)[0] for c in rungs]
    assert full[2] == full[1] and full[3] < full[1], full
    rows = [r for r in plan(model, gpt, 2, 2, 0.0, stages=(2,), offloads=("none",), buckets=(25.0,), acs=("full",),
                            micro_batches=(1,), tps=(1,), pps=(1,))]
    assert [r.candidate.relief for r in rows] == ["", "/tmlp512", "/tmlp512/actoff"], [r.candidate.key for r in rows]
    assert all(b.predicted < a.predicted for a, b in zip(rows, rows[1:]))
    # head groups of sp heads under sp; no head tiling with tp; a restricted ladder
    sp2 = relief_ladder(model, gpt, dataclasses.replace(base, dp=1, sp=2))
    assert sp2[1].tiled_mlp == 512 and sp2[2].tiled_attention == 2
    assert not any(c.tiled_attention for c in relief_ladder(model, gpt, dataclasses.replace(base, dp=1, tp=2)))
    assert relief_ladder(model, gpt, base, relief=("tiled_mlp",)) == rungs[:2]


def test_budget_below_every_whole_layout_picks_the_first_rung_that_fits():
    model, gpt = _long()
    plain = plan(model, gpt, 2, 2, 1e15, relief=(), **SPACE)  # every layout as it is, nothing rejected
    smallest = min(r.predicted for r in plain)
    budget = smallest * 0.9  # no layout fits without relief
    assert not [r for r in plan(model, gpt, 2, 2, budget, relief=(), **SPACE) if not r.reason]
    rows = plan(model, gpt, 2, 2, budget, **SPACE)
    survivors = [r for r in rows if not r.reason]
    assert survivors and all(r.candidate.relief for r in survivors)
    for r in survivors:
        assert r.predicted <= budget
        c = r.candidate
        # the rungs below it were tried and rejected by the budget; none above it was planned
        bare = dict(tiled_mlp=0, tiled_attention=0, act_offload=False, unit_modules=())
        lower = [x for x in rows if x.reason and dataclasses.replace(x.candidate, **bare) == dataclasses.replace(
            c, **bare)]
        assert lower and all("> budget" in x.reason for x in lower)
        assert all(x.predicted > r.predicted for x in lower)
        assert not [x for x in rows if x.candidate != c and x.candidate in relief_ladder(model, gpt, c)[1:]]
    line = survivors[0].candidate.overrides()
    assert any(o.startswith("strategy.tiled_mlp=") for o in line), line
    check_overrides(line, ["model=gpt_mini", f"model.seq_len={L}"])  # real Hydra keys, pre-training checks pass
    # a layout that fits as it is gets no relief: at a roomy budget nothing is relieved
    roomy = [r for r in plan(model, gpt, 2, 2, 1e15, **SPACE) if not r.reason]
    assert roomy and not any(r.candidate.relief for r in roomy)


def test_sp_splits_and_what_rejects_them():
    model, gpt = _long()
    cands, rejected = enumerate_candidates(gpt, 2, 2, sps=(1, 2), tps=(1,), pps=(1,))
    assert {c.sp for c in cands} == {1, 2} and not rejected
    c = next(c for c in cands if c.sp == 2)
    assert (c.dp, c.world, c.split) == (1, 2, "dp1tp1pp1sp2") and "sp2" in c.key and "sp2" in c.family
    assert c.strategy_kwargs()["sp"] == 2 and "strategy.sp=2" in c.overrides()
    # heads, key/value heads, sequence length
    _, rejected = enumerate_candidates(gpt, 8, 8, sps=(8,), tps=(1,), pps=(1,))
    assert "sp=8 does not divide the 4 heads per tp rank" in rejected[0].reason
    _, rejected = enumerate_candidates(dataclasses.replace(gpt, seq_len=4095), 2, 2, sps=(2,), tps=(1,), pps=(1,))
    assert "sp=2 does not divide the sequence length 4095" in rejected[0].reason
    _, rejected = enumerate_candidates(gpt, 4, 4, sps=(2,), tps=(2,), pps=(1,))
    assert not rejected  # 4 heads / tp 2 = 2 per rank, over sp 2
    _, rejected = enumerate_candidates(gpt, 8, 8, sps=(4,), tps=(2,), pps=(1,))
    assert "sp=4 does not divide the 2 heads per tp rank" in rejected[0].reason
    with pytest.raises(ConfigError, match=r"--sp=3 does not divide --devices=2"):
        enumerate_candidates(gpt, 2, 2, sps=(3,))
    with pytest.raises(ConfigError, match=r"--relief=tiled_mlp,tiled_moe: unknown tiled_moe"):
        plan(model, gpt, 2, 2, 1e15, relief=("tiled_mlp", "tiled_moe"), **SPACE)


def test_sp_shrinks_the_prediction_and_the_cli_searches_it_when_nothing_else_fits(capsys):
    model, gpt = _long()
    everything = plan(model, gpt, 2, 2, 0.0, sps=(1, 2), **SPACE)  # every ladder climbed to its top
    whole = min(r.predicted for r in everything if r.candidate.sp == 1)
    split = min(r.predicted for r in everything if r.candidate.sp == 2)
    # 0.91 since ZeRO-3 is predicted in phases (2026-12-07): its backward's end (the root unit, its gradients and
    # the gradient shards) is a floor sp does not lower
    assert split < whole * 0.95, (split, whole)
    budget = (split + whole) / 2
    assert main(["--model", f"gpt_small:seq_len={L}", "--devices", "2", "--global-batch", "2", "--stages", "2,3",
                 "--tp", "1", "--pp", "1", "--memory-budget", str(int(budget)), "--estimate-only"]) == 0
    out = capsys.readouterr().out
    assert "Ulysses (sp) searched too" in out and "strategy.sp=2" in out.splitlines()[-1], out
    # --sp 1 keeps whole sequences: nothing fits, and the message lists the families with their smallest rung
    assert main(["--model", f"gpt_small:seq_len={L}", "--devices", "2", "--global-batch", "2", "--stages", "2,3",
                 "--tp", "1", "--pp", "1", "--sp", "1", "--memory-budget", str(int(budget)), "--estimate-only"]) == 2
    err = capsys.readouterr().err
    assert "no layout fits --memory-budget" in err and "/tmlp512" in err, err
    assert main(["--model", "gpt_tiny", "--devices", "2", "--sp", "two", "--estimate-only"]) == 2
    assert "--sp='two': use sizes like 1,2" in capsys.readouterr().err
