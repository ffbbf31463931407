"""Shared fixtures for the Trainer tests: one single-process reference run for every test module."""

from __future__ import annotations

import pytest
import torch

from test_zero_trainer import COMMON, fit


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """The GPT trained by one process (COMMON settings), with its final state_dict under run["state"]."""
    tmp = tmp_path_factory.mktemp("single")
    run = fit(tmp, "single", "--strategy", "single", "--devices", "1", *COMMON, "--state-dict-out", str(tmp / "sd.pt"))
    run["state"] = torch.load(tmp / "sd.pt")
    return run
