"""checkpoint_async=True with ModelCheckpoint(save_last="link", save_top_k=1) (issue 13, item 5).

Lightning links last.ckpt to the checkpoint it just saved right after the save *starts*; with the write in flight
that folder does not exist yet (before the fix the first link raised FileNotFoundError: the directory was not even
created yet; later ones would dangle). Every write is slowed by 1 s (fit_universal.py's probe) so training runs on
during each; rank 0 records where last.ckpt points at every batch start, write start / end and the end of training
(fit_async_link.py). Uninterrupted: last.ckpt is absent or names a complete checkpoint at every observation, never
the folder in flight, and ends on the last one. Killed (every rank SIGKILLed in the middle of the step-4 write):
last.ckpt names the complete step-2 folder, and fit(ckpt_path="last") resumes from it with the uninterrupted run's
losses, bit for bit.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from lightning_scale.checkpoint import dcp_format
from lightning_scale.testing import run_script

pytestmark = pytest.mark.slow  # three 2-rank Trainer runs with 1 s writes: ~40-70 s on the shared box
SCRIPT = os.path.join(os.path.dirname(__file__), "fit_async_link.py")
ARGS = ["--steps", "6", "--epoch-batches", "2", "--no-predict", "--devices", "2", "--option", "stage=2",
        "--option", "checkpoint_format=universal", "--option", "checkpoint_async=True", "--save-last"]


def fit(tmp, name, *args, env=None, ok=True):
    out, probe = tmp / f"{name}.json", tmp / f"{name}.links.jsonl"
    env = dict(os.environ, LS_TEST_ASYNC_PROBE=str(tmp / f"{name}.writes"), LS_TEST_ASYNC_SLEEP="1.0",
               LS_TEST_LINK_PROBE=str(probe), **(env or {}))
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), *ARGS, "--ckpt-dir", str(tmp / "ckpt"), *args],
                      timeout=300, cwd=tmp, env=env, ranks=2)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    seen = [json.loads(line) for line in probe.read_text().splitlines()]
    return proc, (json.loads(out.read_text()) if ok else None), seen


def _check_observations(seen):
    """Every observation: no link yet, or a link to a complete folder that is not the one being written."""
    writing = None
    during = 0
    for o in seen:
        if o["when"].startswith("write start "):
            writing = o["when"][len("write start "):]
        elif o["when"].startswith("write end "):
            writing = None
        if o["link"] is not None:
            assert o["complete"] and o["link"] != writing, (o, writing)
        during += writing is not None and o["when"] == "batch"
    return during


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_link")
    _, run, seen = fit(tmp, "full")
    return tmp, run, seen


def test_last_link_always_names_a_complete_checkpoint(uninterrupted):
    tmp, run, seen = uninterrupted
    assert len(run["losses"]) == 6
    assert _check_observations(seen) >= 2  # training ran during the writes (batches observed mid-write)
    assert [o["link"] for o in seen if o["when"].startswith("write start")] == \
        [None, "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]  # one save behind while each write is in flight
    ckpt = tmp / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["epoch=2-step=6.ckpt", "last.ckpt"]  # top-1 + the link, no staging
    assert os.readlink(ckpt / "last.ckpt") == "epoch=2-step=6.ckpt"
    assert dcp_format.open_checkpoint(str(ckpt / "last.ckpt"))[1]["step"] == 6


def test_kill_mid_write_leaves_last_link_loadable_and_resumable(tmp_path, uninterrupted):
    _, full, _ = uninterrupted
    proc, _, seen = fit(tmp_path, "killed", env={"LIGHTNING_SCALE_TEST_SAVE_FAULT": "after_rank_file@2:1"}, ok=False)
    assert proc.returncode != 0
    _check_observations(seen)
    ckpt = tmp_path / "ckpt"
    assert [n for n in sorted(os.listdir(ckpt)) if not n.startswith(".")] == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert os.readlink(ckpt / "last.ckpt") == "epoch=0-step=2.ckpt"
    assert dcp_format.open_checkpoint(str(ckpt / "last.ckpt"))[1]["step"] == 2
    _, rerun, _ = fit(tmp_path, "rerun", "--resume", "last")
    assert rerun["losses"] == full["losses"][2:]
    assert sorted(os.listdir(ckpt)) == ["epoch=2-step=6.ckpt", "last.ckpt"]
