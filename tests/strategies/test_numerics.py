"""Numerics that announce themselves (2 CPU ranks, ZeRO-2, one launch for all cases: tests/strategies/fit_numerics.py).

- fp32: a NaN loss on rank 1 at one step -> that step skipped on both ranks, logged, weights stay finite;
- bf16: NaN at every step -> after max_nonfinite_steps=3 in a row, NumericsError naming the step;
- fp16 with an absurd initial scale (2**40): skipped steps and the scale logged (progress bar + metrics); the lr
  scheduler advances through skipped steps, as with torch.amp.GradScaler (documented), and the documented
  ``lr_scheduler_step`` override holds it instead;
- fp16 overflowing every step: the scale falls to its minimum and, pinned there 3 steps, NumericsError suggests bf16.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from lightning_scale.testing import run_script

SCRIPT = os.path.join(os.path.dirname(__file__), "fit_numerics.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("numerics")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    proc = run_script([sys.executable, SCRIPT, "--out", str(tmp / "n.json")], timeout=400, cwd=tmp, env=env, ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "n.json").read_text()), proc.stdout


def test_nan_once_under_fp32_is_skipped_on_every_rank_and_logged(runs):
    results, out = runs
    r = results["fp32_nan_once"]
    assert r["error"] is None and r["finite"] and r["global_step"] == 5
    assert r["final"]["nonfinite_steps"] == 1.0
    assert "global step 2: non-finite loss and gradient norm on some rank: step skipped on every rank" in out


def test_nan_streak_under_bf16_stops_with_the_step(runs):
    r = runs[0]["bf16_nan_streak"]
    assert r["error"].startswith("3 optimizer steps in a row were skipped"), r["error"]
    assert "the last at global step 3" in r["error"] and r["finite"]


def test_fp16_absurd_scale_logs_skips_and_scheduler_behaviour(runs):
    results, _ = runs
    r, held = results["fp16_absurd_scale"], results["fp16_absurd_scale_hold"]
    assert r["error"] is None and r["finite"]
    assert r["final"]["skipped_steps"] == 3.0 and r["final"]["loss_scale"] == 2.0**16  # 2**40 * (2**-8)**3
    assert {"loss_scale", "skipped_steps"} <= set(r["rows"][-1]["bar"])  # on the progress bar
    # default (as AMP's GradScaler): the schedule advances on skipped steps too
    assert [row["sched_count"] for row in r["rows"]] == [1, 2, 3, 4, 5, 6]
    # the documented override: the schedule holds on the 3 skipped steps
    assert held["final"]["skipped_steps"] == 3.0
    assert [row["sched_count"] for row in held["rows"]] == [0, 0, 0, 1, 2, 3]


def test_fp16_scale_pinned_at_minimum_stops_and_suggests_bf16(runs):
    r = runs[0]["fp16_pinned_min"]
    assert r["error"] is not None and "fp16 loss scale pinned at its minimum (1) for 3" in r["error"]
    assert "bf16-mixed" in r["error"] and "global step 7" in r["error"]
    assert r["final"]["loss_scale"] == 1.0
