"""OneBitAdam resumed on another layout through trainer.fit(ckpt_path=...) (issue 13, universal checkpoints).

A Trainer run (zero.stage=1, dp=2, OneBitAdam freeze_step=2, checkpoint_format="universal", 6 steps, a checkpoint
every 3-step epoch) saves at step 3, after one compressed step (the error-feedback buffers exist). Its step-3
checkpoint is resumed for 3 more steps at ZeRO-2 on dp=2 and on 1 device (fit_universal_onebit.py):

- the loaded shards (weights, exp_avg, exp_avg_sq, step, v_step) equal the ranges cut by hand from the checkpoint's
  full tensors (torch's own ``dcp_to_torch_save``): the Adam moments are resharded exactly;
- the losses equal a reference run on the same layout whose tensors all come from those full tensors instead of the
  loader (put into the shards at on_train_start, error feedback dropped; loop state and lr scheduler from the
  checkpoint): float32 1e-5 (measured: equal);
- dp=2 ZeRO-1 -> ZeRO-2: every rank warns that its error-feedback buffers restart from zero, and the losses after the
  first differ from the uninterrupted run's (the buffers did reset); on 1 device OneBitAdam has nothing to compress
  (it is AdamW there) and no buffer exists, so nothing is said about them;
- the same layout (ZeRO-1 dp=2) resumes bit for bit, with no warning.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from lightning_scale.testing import run_script
from test_zero_trainer import script_ranks

pytestmark = pytest.mark.slow  # 6 Trainer launches of ~15-40 s each on the shared 2-core box
SCRIPT = os.path.join(os.path.dirname(__file__), "fit_universal_onebit.py")
ARGS = ["--steps", "6", "--epoch-batches", "3", "--no-predict", "--optimizer", "onebit_adam", "--freeze-step", "2",
        "--option", "checkpoint_format=universal"]
TOL = 1e-5
RESET = "error-feedback buffers for rank {rank} of 2 at ZeRO stage 2 (it was written by another layout): they " \
        "restart from zero"


def fit(tmp, name, *args, env=None, timeout=300):
    out = tmp / f"{name}.json"
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), *ARGS, *args], timeout=timeout, cwd=tmp,
                      env=None if env is None else dict(os.environ, **env), ranks=script_ranks(args))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted ZeRO-1 dp=2 run, its step-3 checkpoint and that checkpoint's full tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = tmp_path_factory.mktemp("universal_onebit")
    run, _ = fit(tmp, "full", "--devices", "2", "--option", "stage=1", "--ckpt-dir", str(tmp / "ckpt"))
    assert run["engines"] == ["OneBitZeroOptimizer"] and len(run["losses"]) == 6
    step3 = tmp / "ckpt" / "epoch=0-step=3.ckpt"
    dcp_to_torch_save(str(step3), str(tmp / "full3.pt"))
    return tmp, run, str(step3)


def _resume(saved, name, devices, stage, mode=None):
    tmp, _, step3 = saved
    state = tmp / f"{name}.full3.pt"
    if not state.exists():
        os.symlink(tmp / "full3.pt", state)  # probe reports go next to it, one name per run
    env = {"LS_TEST_FULL_STATE": str(state)}
    if mode:
        env["LS_TEST_FULL_STATE_MODE"] = mode
    run, log = fit(tmp, name, "--devices", str(devices), "--option", f"stage={stage}", "--resume", step3, env=env)
    probes = [json.loads((tmp / f"{name}.full3.pt.{r}.json").read_text()) for r in range(devices)]
    return run, log, probes


def _close(a, b):
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= TOL, (a, b)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("devices", [2, 1], ids=["zero1_dp2_to_zero2_dp2", "zero1_dp2_to_zero2_dp1"])
def test_onebit_resumes_on_another_layout_as_from_the_same_full_state(saved, devices):
    _, full, _ = saved
    run, log, probes = _resume(saved, f"resume{devices}", devices, stage=2)
    ref, _, _ = _resume(saved, f"reference{devices}", devices, stage=2, mode="overwrite")
    assert run["world"] == devices and run["engines"] == ["OneBitZeroOptimizer"]
    for p in probes:  # what the loader put in every rank's shards, against the full tensors
        assert p["stage"] == 2 and p["global_step"] == 3 and p["mode"] == "compare"
        assert p["diffs"] == {"weights": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "step": 0.0, "v_step": 0.0}, p
    print(f"dp{devices}: resumed {run['losses']}, reference {ref['losses']}, uninterrupted {full['losses'][3:]}")
    _close(run["losses"], ref["losses"])
    if devices == 2:
        for rank in range(2):
            assert RESET.format(rank=rank) in log, log[-3000:]
        assert run["losses"][0] == full["losses"][3]  # the same state before the first resumed step ...
        assert abs(run["losses"][1] - full["losses"][4]) > 1e-4  # ... then the buffers it dropped show
    else:
        assert "error-feedback" not in log


@pytest.mark.timeout(600)
def test_onebit_same_layout_resume_is_bit_identical(saved):
    tmp, full, step3 = saved
    run, log = fit(tmp, "same", "--devices", "2", "--option", "stage=1", "--resume", step3)
    assert run["losses"] == full["losses"][3:]
    assert "error-feedback" not in log
