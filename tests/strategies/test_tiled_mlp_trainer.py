"""Zero3DStrategy(tiled_mlp=N) through a real Trainer (issue 16): 2 CPU ranks, ZeRO-3 with full activation
checkpointing, the MLPs tiled 4 positions at a time and the attention 2 heads at a time (``tiled_attention=2``); float32 training losses (gradient accumulation 2, clipping
0.5) and the validation loss equal the single-process untiled run within 1e-5.
"""

from __future__ import annotations

import pytest

from test_zero_trainer import COMMON, fit


@pytest.mark.timeout(180)
def test_zero3_ac_tiled_mlp_losses_match_single_process(tmp_path, single):
    run = fit(tmp_path, "tiled", "--devices", "2", "--option", "stage=3", "--option", "activation_checkpointing=full",
              "--option", "tiled_mlp=4", "--option", "tiled_attention=2", *COMMON, "--no-predict")
    assert run["world"] == 2 and len(run["losses"]) == len(single["losses"]) == 8
    diff = max(abs(a - b) for a, b in zip(run["losses"], single["losses"]))
    assert diff < 1e-5, (run["losses"], single["losses"])
    assert abs(run["val"][0]["val_loss"] - single["val"][0]["val_loss"]) < 1e-5
