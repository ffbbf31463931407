"""Real Trainer(accelerator="cpu", devices=2) runs at ZeRO stage 3 and with offload (scripts, own processes)."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_scale import ConfigError, Zero3DStrategy

from lightning_scale.models.gpt import GPT, GPTConfig, make_batch
from lightning_scale.zero.state_dict import consolidate_checkpoint

from test_zero_trainer import COMMON, fit


# `single` (the one-process reference run) is a session fixture in conftest.py


@pytest.mark.parametrize("strategy", ["zero3", "zero2_offload", "zero3_offload"])
def test_trainer_losses_match_single_process(tmp_path, single, strategy):
    run = fit(tmp_path, strategy, "--strategy", strategy, "--devices", "2", *COMMON)
    assert run["world"] == 2 and len(run["losses"]) == len(single["losses"]) == 8
    diff = max(abs(a - b) for a, b in zip(run["losses"], single["losses"]))
    assert diff < 1e-5, (run["losses"], single["losses"])
    assert abs(run["val"][0]["val_loss"] - single["val"][0]["val_loss"]) < 1e-5
    assert run["engines"] == (["Stage3Optimizer"] if strategy.startswith("zero3") else ["ZeroOptimizer"])
    assert run["n_predict"] > 0  # predict after fit gathers through the kept hooks


def test_stage3_resume_is_identical_and_consolidated_file_loads_into_plain_model(tmp_path):
    args = ["--strategy", "zero3", "--devices", "2", "--steps", "4", "--accumulate", "2", "--clip", "0.5",
            "--epoch-batches", "4", "--precision", "bf16-mixed"]
    ckpt = tmp_path / "ckpt"
    full = fit(tmp_path, "full", *args, "--ckpt-dir", str(ckpt), "--probe")
    first, last = ckpt / "epoch=0-step=2.ckpt", ckpt / "epoch=1-step=4.ckpt"
    assert (first / "optim_rank1.pt").exists() and (last / "meta.pt").exists()
    resumed = fit(tmp_path, "resumed", *args, "--resume", str(first))
    assert resumed["losses"] == full["losses"][4:]  # bit-identical: shards, fp32 masters, Adam state restored
    # One plain file, plain torch: fp32 masters of the final step load into the untouched GPT class.
    out = tmp_path / "consolidated.pt"
    consolidate_checkpoint(str(last), strip_prefix="model.", out=str(out))
    state = torch.load(out, weights_only=True)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
    model = GPT(cfg)
    model.load_state_dict(state, strict=True)
    assert all(v.dtype == torch.float32 for v in state.values())
    x, y = make_batch(cfg, 2, seed=123)
    with torch.no_grad():  # the sharded model computed in bf16 from the same masters cast to bf16
        plain = float(model.to(torch.bfloat16).loss(x, y))
    assert abs(plain - full["probe"]) < 1e-5, (plain, full["probe"])


@pytest.mark.parametrize("options,message", [
    ({"stage": 3, "prefetch_depth": -1}, "prefetch_depth=-1 must be >= 0"),
    ({"stage": 3, "persistent_threshold": -5}, "persistent_threshold=-5 must be >= 0"),
    ({"stage": 2, "offload": "nvme"}, "offload='nvme'"),
    ({"stage": 2, "offload": {"optimizer": "cuda:7"}}, "offload='cuda:7': must be one of none, cpu"),
    ({"stage": 2, "offload": "params"}, "parameter offload needs stage=3"),
    ({"stage": 0, "offload": "optimizer"}, "optimizer offload needs stage >= 1"),
])
def test_bad_stage3_and_offload_settings_raise_at_construction(options, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Zero3DStrategy(**options)


def test_unit_class_matching_nothing_fails_fast_on_every_rank(tmp_path):
    proc, elapsed = fit(tmp_path, "bad", "--devices", "2", "--option", "stage=3",
                        "--option", "unit_modules=('NoSuchBlock',)", timeout=240, expect_ok=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "unit_modules entry 'NoSuchBlock' matches no module class or name" in out, out[-3000:]
    assert "Block" in out  # the message lists the classes it could have meant
    # no hang: an error that did not reach every rank would wait out hang_timeout (300 s) and run_script's timeout
    # (240 s) fails the test; the time is printed, not asserted (it is mostly start-up, and varies with load)
    print(f"ended by itself in {elapsed:.1f} s")
