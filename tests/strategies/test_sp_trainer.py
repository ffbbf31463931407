"""Ulysses sequence parallelism through a real Trainer(accelerator="cpu", devices=2, strategy=Zero3DStrategy(sp=2)).

Each rank trains on its half of every sequence (the strategy slices the batch; the sampler splits over dp = 1 only):
the GPT's float32 training losses (gradient accumulation 2, clipping 0.5: the global norm spans sp) and its
validation loss match the single-process run on the full sequences.
"""

from __future__ import annotations

import pytest

from test_zero_trainer import COMMON, fit


# `single` (the one-process reference run) is a session fixture in conftest.py


@pytest.mark.timeout(180)
def test_sp2_zero3_losses_match_single_process(tmp_path, single):
    run = fit(tmp_path, "sp2", "--devices", "2", "--option", "sp=2", "--option", "stage=3", *COMMON,
              "--record-batches", "--no-predict")
    assert run["world"] == 2 and len(run["losses"]) == len(single["losses"]) == 8
    diff = max(abs(a - b) for a, b in zip(run["losses"], single["losses"]))
    assert diff < 1e-5, (run["losses"], single["losses"])
    assert abs(run["val"][0]["val_loss"] - single["val"][0]["val_loss"]) < 1e-5
    for sums, logged in zip(run["batch_sums"], run["logged"]):
        assert sums[0] != sums[1], sums  # each rank holds a different half of the same sequences
        assert abs(logged[0] - logged[1]) < 1e-6, logged  # the whole-sequence loss, on both sp ranks
