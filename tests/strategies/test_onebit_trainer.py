"""Trainer(accelerator="cpu", devices=2, strategy="zero1"/"zero2") with OneBitAdam from configure_optimizers."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from lightning_scale.testing import run_script
from test_zero_trainer import script_ranks

SCRIPT = os.path.join(os.path.dirname(__file__), "fit_gpt.py")
ONEBIT = ["--devices", "2", "--optimizer", "onebit_adam"]


def fit(tmp_path, name, *args, timeout=120, expect_ok=True):
    out = tmp_path / f"{name}.json"
    start = time.monotonic()
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), *args], timeout=timeout, cwd=tmp_path,
                      ranks=script_ranks(args))
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return json.loads(out.read_text())
    return proc, time.monotonic() - start


def test_zero2_onebit_adam_trains(tmp_path):
    run = fit(tmp_path, "onebit", "--strategy", "zero2", *ONEBIT, "--freeze-step", "6", "--steps", "30",
              "--source", "stdlib", "--seq-len", "32", "--global-batch", "16", timeout=120)
    assert run["engines"] == ["OneBitZeroOptimizer"]  # the ZeRO-2 engine, not stage-0 OneBitAdam
    losses = run["losses"]
    assert len(losses) == 30
    tail = sum(losses[-5:]) / 5
    assert losses[0] - tail > 1.0, losses  # it learned, also after the freeze at step 6
    assert sum(losses[6:11]) / 5 - tail > 0.3, losses


def test_zero1_onebit_checkpoint_resumes_identically(tmp_path):
    # freeze_step=1: the checkpoint after step 2 is in the compression stage (error buffers in it).
    args = ["--strategy", "zero1", *ONEBIT, "--freeze-step", "1", "--steps", "4", "--epoch-batches", "2"]
    ckpt = tmp_path / "ckpt"
    full = fit(tmp_path, "full", *args, "--ckpt-dir", str(ckpt), timeout=120)
    first = ckpt / "epoch=0-step=2.ckpt"
    assert (first / "optim_rank0.pt").exists() and (first / "optim_rank1.pt").exists()
    resumed = fit(tmp_path, "resumed", *args, "--resume", str(first), timeout=120)
    assert full["engines"] == ["OneBitZeroOptimizer"]
    assert resumed["losses"] == full["losses"][2:]  # bit-identical continuation


@pytest.mark.parametrize("args,message", [
    # refused at setup (before any step), naming the Trainer flag
    (["--strategy", "zero2", "--clip", "0.5"], "gradient_clip_val=0.5: OneBitAdam with stage=2 cannot clip"),
    (["--option", "stage=3"], "stage=3: OneBitAdam supports ZeRO stages"),
])
def test_onebit_zero_bad_settings_fail_clearly(tmp_path, args, message):
    proc, elapsed = fit(tmp_path, "bad", *ONEBIT, "--freeze-step", "1", *args, timeout=240, expect_ok=False)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
    # no hang: an error that did not reach every rank would wait out hang_timeout (300 s) and run_script's timeout
    # (240 s) fails the test; the time is printed, not asserted (it is mostly start-up, and varies with load)
    print(f"ended by itself in {elapsed:.1f} s")
