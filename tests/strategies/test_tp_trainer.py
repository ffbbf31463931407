"""Tensor parallelism through a real Trainer(accelerator="cpu", devices=4, strategy=Zero3DStrategy(tp=2, stage=1|2|3)).

dp=2 x tp=2: the GPT's float32 losses, validation loss and predictions match the single-process run, tp peers
read the same batch, the consolidated state_dict has the original model's keys and shapes, a sharded
checkpoint resumes bit for bit, and bad settings fail on every rank before training.
"""

from __future__ import annotations

import pytest
import torch

from test_zero_trainer import COMMON, fit

TP = ["--devices", "4", "--option", "tp=2"]


# `single` (the one-process reference run) is a session fixture in conftest.py


@pytest.mark.timeout(120)
# stage 2 with dp=2 x tp=2 is checked at float64 in tests/dist/test_tp_zero.py; here stage 1 and stage 3
@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_dp2_losses_match_single_process(tmp_path, single, stage):
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt")] if stage == 3 else []
    run = fit(tmp_path, f"tp2-zero{stage}", *TP, "--option", f"stage={stage}", *COMMON, "--record-batches",
              "--state-dict-out", str(tmp_path / "sd.pt"), *ckpt)
    assert run["world"] == 4 and len(run["losses"]) == len(single["losses"]) == 8
    diff = max(abs(a - b) for a, b in zip(run["losses"], single["losses"]))
    assert diff < 1e-5, (run["losses"], single["losses"])
    assert abs(run["val"][0]["val_loss"] - single["val"][0]["val_loss"]) < 1e-5
    assert abs(run["test"][0]["test_loss"] - single["test"][0]["test_loss"]) < 1e-5
    assert run["pred0"] == single["pred0"]  # vocabulary-split logits gathered before the argmax
    # rank = dp_index * tp + tp_index: ranks (0, 1) and (2, 3) are tp peers
    for sums, logged in zip(run["batch_sums"], run["logged"]):
        assert sums[0] == sums[1] and sums[2] == sums[3] and sums[0] != sums[2], sums
        assert logged[0] == logged[1] and logged[2] == logged[3], logged  # vocab-parallel loss: same on tp peers
    # consolidated: the original GPT's keys and shapes (vocabulary padding dropped), the trained values
    state, ref = torch.load(tmp_path / "sd.pt"), single["state"]
    assert list(state) == list(ref)
    assert all(state[k].shape == ref[k].shape for k in ref)
    worst = max((state[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < 1e-4, worst  # float32 AdamW: tiny gradients amplify rounding (plain ZeRO-1 shows ~1e-5)
    if stage == 3:
        # ZeRO-3 x tp checkpoint folder: every rank's shards merged over dp, then over tp, offline
        from lightning_scale.zero.state_dict import consolidate_checkpoint

        (folder,) = list((tmp_path / "ckpt").iterdir())
        offline = consolidate_checkpoint(str(folder))
        assert sorted(offline) == sorted(state)
        assert all(torch.equal(offline[k], state[k]) for k in state)


@pytest.mark.timeout(120)
def test_tp2_sequence_parallel_zero2_matches_single_process(tmp_path, single):
    """Partial LayerNorm / bias gradients are summed over tp before ZeRO-2 reduces them (overlap off)."""
    run = fit(tmp_path, "sp", "--devices", "2", "--option", "tp=2", "--option", "stage=2",
              "--option", "sequence_parallel=True", *COMMON)
    diff = max(abs(a - b) for a, b in zip(run["losses"], single["losses"]))
    assert diff < 1e-5, (run["losses"], single["losses"])
    assert abs(run["val"][0]["val_loss"] - single["val"][0]["val_loss"]) < 1e-5


@pytest.mark.timeout(120)
def test_tp2_checkpoint_resume_gives_identical_losses(tmp_path):
    # dp=1 x tp=2 (two processes keep the test short; dp x tp sharding is covered above)
    args = ["--devices", "2", "--option", "tp=2", "--option", "stage=1", "--steps", "4", "--accumulate", "2",
            "--clip", "0.5", "--epoch-batches", "4", "--no-predict"]
    ckpt = tmp_path / "ckpt"
    final = ckpt / "epoch=1-step=4.ckpt"
    full = fit(tmp_path, "full", *args, "--ckpt-dir", str(ckpt), "--test-ckpt", str(final))
    # trainer.test(ckpt_path=) after fit loads the consolidated checkpoint into the already split model
    assert abs(full["test"][1]["test_loss"] - full["test"][0]["test_loss"]) < 1e-6, full["test"]
    first = ckpt / "epoch=0-step=2.ckpt"
    assert all((first / f"optim_rank{r}.pt").exists() for r in range(2))
    saved = torch.load(first / "checkpoint.pt", weights_only=False)["state_dict"]
    assert saved["model.lm_head.weight"].shape == (64, 32)  # full, not the (32, 32) slice of tp rank 0
    resumed = fit(tmp_path, "resumed", *args, "--resume", str(first))
    assert resumed["losses"] == full["losses"][4:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,message", [
    (["--devices", "3", "--option", "tp=3"], "tp=3 does not divide"),
    (["--devices", "2", "--option", "tp=2", "--option", "plan={'blocks.*.attn.qkv':'diagonal'}"], "diagonal"),
])
def test_tp_bad_settings_fail_on_every_rank(tmp_path, args, message):
    proc, elapsed = fit(tmp_path, "bad", *args, "--steps", "1", timeout=240, expect_ok=False)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    # no hang: an error that did not reach every rank would wait out hang_timeout (300 s) and run_script's timeout
    # (240 s) fails the test; the time is printed, not asserted (it is mostly start-up, and varies with load)
    print(f"ended by itself in {elapsed:.1f} s")
