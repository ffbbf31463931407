"""Shared fixtures for the Trainer tests: one single-process reference run for every test module.

Under pytest-xdist (`-n N`; not what CI runs, see README, Tests) each worker is a session of its own: the run is
made once, by the first worker that needs it, under a file lock in the directory every worker's base temp sits in;
the others read it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from test_zero_trainer import COMMON, fit


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """The GPT trained by one process (COMMON settings), with its final state_dict under run["state"]."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # no xdist: this session is the only one
        tmp = tmp_path_factory.mktemp("single")
        run = fit(tmp, "single", "--strategy", "single", "--devices", "1", *COMMON, "--state-dict-out",
                  str(tmp / "sd.pt"))
    else:
        from filelock import FileLock

        tmp = tmp_path_factory.getbasetemp().parent / "single"  # shared by the workers of this run
        with FileLock(str(tmp) + ".lock"):
            done = tmp / "run.json"
            if not done.exists():
                tmp.mkdir(exist_ok=True)
                run = fit(tmp, "single", "--strategy", "single", "--devices", "1", *COMMON, "--state-dict-out",
                          str(tmp / "sd.pt"))
                done.write_text(json.dumps(run))
            run = json.loads(done.read_text())
    run["state"] = torch.load(tmp / "sd.pt")
    return run
