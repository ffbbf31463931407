"""The autotuner without processes (lightning_scale.tune): pruning by the memory plan, the pick, bad input, resume."""

from __future__ import annotations

import functools
import json

import pytest

from lightning_scale.config import ConfigError
from lightning_scale.estimate import _model_from_spec
from lightning_scale.tune import Candidate, check_overrides, enumerate_candidates, main, no_fit_message, plan, tune

SPACE = dict(tps=(1,), pps=(1,), acs=(None, "full"), relief=())  # the constructions below: no relief ladder


@functools.lru_cache(maxsize=None)
def _model():
    return _model_from_spec("gpt_small")


def _offloaded3(c: Candidate) -> bool:
    return c.stage == 3 and c.offload != "none"


def only_stage3_offload_budget(model, global_batch: int = 4) -> float:
    """A budget between the smallest stage-3 + offload layout and the smallest of every other layout."""
    rows = plan(model, model.cfg, 2, global_batch, 1e15, **SPACE)
    z3 = min(r.predicted for r in rows if not r.reason and _offloaded3(r.candidate))
    rest = min(r.predicted for r in rows if not r.reason and not _offloaded3(r.candidate))
    assert z3 < rest
    return (z3 + rest) / 2


def test_budget_where_only_stage3_offload_fits_picks_it():
    model = _model()
    rows = plan(model, model.cfg, 2, 4, only_stage3_offload_budget(model), **SPACE)
    survivors = [r for r in rows if not r.reason]
    assert survivors and all(_offloaded3(r.candidate) for r in survivors)
    assert survivors[0].candidate.stage == 3 and survivors[0].candidate.offload != "none"
    rejected = [r for r in rows if r.reason]
    assert any(r.candidate.stage == 0 and "> budget" in r.reason for r in rejected)
    line = survivors[0].candidate.overrides()
    assert "strategy.stage=3" in line and f"strategy.offload={survivors[0].candidate.offload}" in line
    check_overrides(line, ["model=gpt_mini"])  # real Hydra keys, accepted by the pre-training checks


def test_no_fit_lists_every_family_and_why(capsys):
    model = _model()
    rows = plan(model, model.cfg, 2, 4, 2**20, **SPACE)
    assert not [r for r in rows if not r.reason]
    msg = no_fit_message(rows, 2**20)
    for stage, offload in ((0, "none"), (1, "optimizer"), (2, "none"), (3, "all")):
        assert f"stage {stage} offload={offload} dp2" in msg
    assert msg.count("> budget 1.0 MiB") >= 9, msg
    assert main(["--model", "gpt_tiny", "--devices", "2", "--memory-budget", "1KiB", "--estimate-only"]) == 2
    err = capsys.readouterr().err
    assert "no layout fits --memory-budget=0.0 MiB" in err and "stage 3 offload=all dp2" in err


def test_bad_devices_named():
    gpt = _model().cfg
    with pytest.raises(ConfigError, match=r"--tp=3 does not divide --devices=2"):
        enumerate_candidates(gpt, 2, 4, tps=(3,))
    with pytest.raises(ConfigError, match=r"--devices=0 must be a positive integer"):
        enumerate_candidates(gpt, 0, 4)
    cands, rejected = enumerate_candidates(gpt, 2, 3, tps=(1,), pps=(1,))
    assert not cands and "--global-batch=3 sequences is not divisible by dp=2" in rejected[0].reason
    _, rejected = enumerate_candidates(gpt, 8, 8, tps=(8,), pps=(1,))
    assert "tp=8 does not divide model.n_head=4" in rejected[0].reason


def test_resume_skips_finished_candidates(tmp_path):
    model = _model()
    rows = plan(model, model.cfg, 2, 4, 1e15, stages=(2,), offloads=("none",), **SPACE)
    path = str(tmp_path / "tune.jsonl")
    calls = []

    def fake(gpt, c, **kw):
        calls.append(c.key)
        return {"tokens_per_s": 1000.0 + len(calls), "measured_bytes": 1.0}

    first = tune(rows, model.cfg, max_probes=2, results_path=path, measure_fn=fake, log=lambda s: None,
                 confirm=0)
    assert len(calls) == 2 and len(first) == 2
    assert [json.loads(line)["key"] for line in open(path)] == calls
    done, calls[:] = list(calls), []
    logs = []
    again = tune(rows, model.cfg, max_probes=1, results_path=path, measure_fn=fake, log=logs.append, confirm=0)
    assert calls and not set(calls) & set(done)  # finished ones read back, not measured
    assert sum("skipped" in line for line in logs) == 2 and len(again) == 3


def test_failed_probes_are_listed_after_the_ranked_rows():
    from lightning_scale.tune import format_ranked

    model = _model()
    rows = plan(model, model.cfg, 2, 4, 1e15, stages=(2,), offloads=("none",), **SPACE)

    def fake(gpt, c, **kw):
        if c.key == rows[0].candidate.key:
            raise RuntimeError("CUDA out of memory on rank 1")
        return {"tokens_per_s": 1000.0, "measured_bytes": 1.0}

    ranked = tune(rows, model.cfg, max_probes=2, measure_fn=fake, log=lambda s: None, confirm=0)
    failed = [r for r in rows if r.result and "error" in r.result]
    assert len(ranked) == 1 and [r.candidate.key for r in failed] == [rows[0].candidate.key]
    table = format_ranked(ranked, failed=failed)
    assert table.splitlines()[-1].startswith(f"| - | {rows[0].candidate.key} | failed: RuntimeError: CUDA out of "
                                             f"memory on rank 1 |"), table


def test_probe_device_is_never_a_silent_cpu_fallback(monkeypatch):
    """``--device auto`` probes on the GPUs of a GPU machine; a machine with fewer GPUs than ``--devices`` is an error,
    not a CPU measurement of a GPU layout; ``cuda`` without CUDA is named."""
    import torch

    from lightning_scale.tune import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 2) == "cpu" and resolve_device("cpu", 2) == "cpu"
    with pytest.raises(ConfigError, match=r"--device=cuda: this machine has no CUDA device"):
        resolve_device("cuda", 1)
    with pytest.raises(ConfigError, match=r"--device='gpu': choose auto, cpu or cuda"):
        resolve_device("gpu", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto", 1) == "cuda" and resolve_device("cpu", 2) == "cpu"
    with pytest.raises(ConfigError, match=r"--devices=2: this machine has 1 GPU\(s\) and the CLI's probes run on one"):
        resolve_device("auto", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--model", "gpt_tiny", "--devices", "1", "--device", "cuda", "--max-probes", "1"]) == 2
