"""Every rank killed while ModelCheckpoint overwrites last.ckpt: ckpt_path="last" resumes the previous step.

Before the staged save (lightning_scale.checkpoint.folder) this left rank 0's new shard and checkpoint.pt next
to rank 1's old shard and meta.pt, and ckpt_path="last" loaded that mix with rc 0 and no warning.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from test_zero_trainer import SCRIPT, fit

from lightning_scale.strategies.checkpoint import load_sharded

ARGS = ["--devices", "2", "--steps", "6", "--accumulate", "2", "--clip", "0.5", "--epoch-batches", "4"]  # 2 steps/epoch


def _killed_run(tmp_path, ckpt, strategy, fault):
    env = dict(os.environ, LIGHTNING_SCALE_TEST_SAVE_FAULT=fault)
    cmd = [sys.executable, SCRIPT, "--out", str(tmp_path / "killed.json"), "--strategy", strategy, *ARGS,
           "--ckpt-dir", str(ckpt), "--save-last"]
    # its own session: the hook SIGKILLs the job's whole process group (every rank), not pytest
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    assert not (tmp_path / "killed.json").exists()


def test_killed_overwrite_of_last_resumes_previous_step(tmp_path):
    strategy = "zero2"
    full = fit(tmp_path, "full", "--strategy", strategy, *ARGS)
    ckpt = tmp_path / "ckpt"
    # saves: epoch=0-step=2, last (step 2), epoch=1-step=4, last (step 4) <- every rank dies in this one, once
    # rank 0 has written its new files
    _killed_run(tmp_path, ckpt, strategy, "after_rank_file@4:0")
    steps = {load_sharded(str(ckpt / "last.ckpt"), r, 2)["global_step"] for r in range(2)}
    assert steps == {2}, steps
    resumed = fit(tmp_path, "resumed", "--strategy", strategy, *ARGS, "--ckpt-dir", str(ckpt), "--save-last",
                  "--resume", "last")
    assert resumed["losses"] == full["losses"][4:]  # steps 3-6, bit for bit: nothing of step 4 leaked in
    # the killed save's staging folder was tidied up by the next save of last.ckpt
    assert not [name for name in os.listdir(ckpt) if name.startswith(".")], os.listdir(ckpt)
