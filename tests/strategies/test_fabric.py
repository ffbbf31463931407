"""Lightning Fabric on the composition core: Fabric(strategy="zero2" | Zero3DFabricStrategy(...)).

Float64 parity with one process at dp=2 for stages 0-3 and offload, dp=2 x tp=2 at stages 1 and 3 (fit_fabric.py
runs every layout of a world size in one launch), accumulation under ``fabric.no_backward_sync``, save -> load
bit-identical, a Trainer checkpoint into Fabric and back into the Trainer, bad settings.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch

from lightning_scale.testing import run_script

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "fit_fabric.py")
sys.path.insert(0, HERE)

DP2 = [("stage0", dict(stage=0), False), ("stage1", dict(stage=1), False), ("stage2", dict(stage=2), True),
       ("stage3", dict(stage=3), True), ("stage2_offload", dict(stage=2, offload="optimizer"), False),
       ("stage3_offload", dict(stage=3, offload="all"), False),
       ("stage3_compile", dict(stage=3, compile={"backend": "aot_eager"}), True)]  # compiled per block, resumed
TP2 = [("tp2_stage1", dict(stage=1, tp=2), False), ("tp2_stage3", dict(stage=3, tp=2), True)]


def _launch(tmp, *args, devices=2, timeout=300, expect_ok=True):
    out = tmp / "result.json"
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), "--tmp", str(tmp), "--devices", str(devices),
                       *args], timeout=timeout, cwd=str(tmp), merge_stderr=True, ranks=devices)
    if not expect_ok:
        return proc
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [json.loads((tmp / f"result.json.rank{r}").read_text()) for r in range(devices)]


@functools.lru_cache(maxsize=None)
def _reference():
    """One process, float64: the same micro-batches, accumulation, clipping and AdamW groups."""
    from fit_fabric import BATCH, CLIP, LR, MICRO, MODEL, STEPS, batches, groups  # noqa: F401

    from lightning_scale.models.gpt import GPT, gpt_tiny

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = GPT(gpt_tiny(**MODEL))
        opt = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.95))
        losses, norms = [], []
        for step in range(STEPS):
            total = 0.0
            for x, y in batches(step):
                loss = model.loss(x, y) / MICRO
                loss.backward()
                total += loss.item()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
            opt.zero_grad()
            losses.append(total)
        return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_default_dtype(previous)


def _check(tmp, ranks, layouts):
    ref_losses, ref_norms, ref_state = _reference()
    for name, _, resume in layouts:
        for rank, res in enumerate(ranks):
            row = res[name]
            assert max(abs(a - b) for a, b in zip(row["losses"], ref_losses)) < 1e-10, (name, rank, row["losses"])
            assert max(abs(a - b) for a, b in zip(row["norms"], ref_norms)) < 1e-10, (name, rank, row["norms"])
            if resume:
                assert row["resume"]["step"] == 2 and row["resume"]["same_keys"], (name, rank, row["resume"])
                assert row["resume"]["max_diff"] == 0.0, (name, rank, row["resume"])  # bit-identical
        final = torch.load(tmp / f"{name}.pt")
        assert sorted(final) == sorted(ref_state), name
        worst = max((final[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < 1e-10, (name, worst)


@pytest.mark.timeout(420)
def test_fabric_dp2_every_stage_and_offload_match_one_process(tmp_path):
    ranks = _launch(tmp_path, "--suite", "parity", "--layouts", repr(DP2))
    assert [ranks[0][n]["engine"] for n, _, _ in DP2] == [
        "ZeroOptimizer", "ZeroOptimizer", "ZeroOptimizer", "Stage3Optimizer", "ZeroOptimizer", "Stage3Optimizer",
        "Stage3Optimizer"]
    assert [ranks[0][n]["compiled"] for n, _, _ in DP2] == [0] * 6 + [2]  # the compiled layout's 2 blocks
    _check(tmp_path, ranks, DP2)


@pytest.mark.timeout(420)
def test_fabric_dp2_tp2_matches_one_process(tmp_path):
    _check(tmp_path, _launch(tmp_path, "--suite", "parity", "--layouts", repr(TP2), devices=4), TP2)


@pytest.mark.timeout(420)
def test_trainer_checkpoint_into_fabric_and_back(tmp_path):
    """A zero2 Trainer checkpoint (step 2) loads into Fabric; Fabric saves it again; the Trainer resumes from
    Fabric's folder with the losses of the uninterrupted Trainer run, bit for bit."""
    from test_zero_trainer import fit

    args = ["--strategy", "zero2", "--devices", "2", "--steps", "4", "--accumulate", "2", "--clip", "0.5",
            "--epoch-batches", "4"]
    full = fit(tmp_path, "full", *args, "--ckpt-dir", str(tmp_path / "ckpt"))
    first = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    ranks = _launch(tmp_path, "--suite", "trainer", "--ckpt", str(first), "--resave", str(tmp_path / "fabric.ckpt"))
    for res in ranks:
        assert res["keys"] and res["worst"] == 0.0, res
        assert res["inner_steps"] == [2], res  # the optimizer shards' state came along (Adam's step count)
        assert {"loops", "lr_schedulers", "global_step", "epoch"} <= set(res["rest"]), res["rest"]
    resumed = fit(tmp_path, "resumed", *args, "--resume", str(tmp_path / "fabric.ckpt"))
    assert resumed["losses"] == full["losses"][4:]


@pytest.mark.parametrize("kw,message", [
    (dict(stage=1, tp=3), "tp=3 x pp=1 does not divide the world size 2"),
    (dict(stage=3, stgae=1), "unknown option 'stgae'"),
])
def test_fabric_bad_settings_fail_on_every_rank(tmp_path, kw, message):
    proc = _launch(tmp_path, "--suite", "bad", "--layouts", repr(kw), timeout=120, expect_ok=False)
    assert proc.returncode != 0 and message in proc.stdout, proc.stdout[-3000:]
    assert not list(tmp_path.glob("result.json.rank*"))  # nobody reached training


def test_fabric_rejects_pipeline_with_the_alternative():
    from lightning_scale.config import ConfigError
    from lightning_scale.strategies import Zero3DFabricStrategy

    with pytest.raises(ConfigError, match="pp=2: pipeline parallelism is not available under Fabric"):
        Zero3DFabricStrategy(pp=2, microbatches=2)


def test_fabric_registry_has_every_preset():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import lightning_scale  # noqa: F401
    from lightning_scale.config import PRESETS

    for name, (kwargs, _) in PRESETS.items():
        assert STRATEGY_REGISTRY[name]["init_params"] == kwargs, name
