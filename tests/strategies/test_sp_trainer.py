"""Ulysses sequence parallelism through a real Trainer(accelerator="cpu", devices=2, strategy=Zero3DStrategy(sp=2)).

Each rank trains on its half of every sequence (the strategy slices the batch; the sampler splits over dp = 1 only):
the GPT's float32 training losses (gradient accumulation 2, clipping 0.5: the global norm spans sp) and its
validation loss match the single-process run on the full sequences; a sharded ZeRO-3 checkpoint written under sp=2
resumes with bit-identical losses.
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


@pytest.mark.timeout(180)
def test_sp2_zero3_checkpoint_resumes_bit_for_bit(tmp_path):
    """A sharded checkpoint written under sp=2 (ZeRO-3 over dp x sp: each rank a different shard) resumes on the same
    layout with the uninterrupted run's losses."""
    args = ["--devices", "2", "--option", "sp=2", "--option", "stage=3", "--steps", "4", "--accumulate", "2",
            "--clip", "0.5", "--epoch-batches", "4", "--no-predict"]
    ckpt = tmp_path / "ckpt"
    full = fit(tmp_path, "full", *args, "--ckpt-dir", str(ckpt))
    first = ckpt / "epoch=0-step=2.ckpt"
    assert (first / "optim_rank0.pt").exists() and (first / "optim_rank1.pt").exists()
    resumed = fit(tmp_path, "resumed", *args, "--resume", str(first))
    assert len(resumed["losses"]) == 4  # the micro-batches of steps 3 and 4
    assert resumed["losses"] == full["losses"][4:]


# ------------------------------------------------------------------------------------------------ Fabric
FABRIC_SP = [("sp2_stage3_loader", dict(sp=2, stage=3), "loader"), ("sp2_stage0_shard", dict(sp=2, stage=0), "shard")]


FABRIC_SP_TP = [("sp2_tp2_stage1_loader", dict(sp=2, tp=2, stage=1), "loader"),
                ("sp2_tp2_stage3_shard", dict(sp=2, tp=2, stage=3), "shard")]


@pytest.mark.timeout(240)
def test_fabric_sp2_matches_one_process(tmp_path):
    """Zero3DFabricStrategy(sp=2) on 2 ranks (dp = 1), float64: each rank holds half of every sequence (cut by
    setup_dataloaders, or by strategy.shard_batch), the model's loss is the whole-sequence mean; losses, clipped norms
    and parameters equal one process on the full sequences (test_fabric's reference) within 1e-10."""
    _fabric_sp(tmp_path, FABRIC_SP, 2)


@pytest.mark.timeout(300)
def test_fabric_sp2_tp2_matches_one_process(tmp_path):
    """The same at sp=2 x tp=2 on 4 ranks (ZeRO 1 and 3; the vocabulary-parallel loss summed per slice)."""
    _fabric_sp(tmp_path, FABRIC_SP_TP, 4)


def _fabric_sp(tmp_path, layouts, devices: int):
    import json
    import os
    import sys

    import torch

    from lightning_scale.testing import run_script

    here = os.path.dirname(__file__)
    sys.path.insert(0, here)
    from test_fabric import _reference

    out = tmp_path / "result.json"
    proc = run_script([sys.executable, os.path.join(here, "fit_fabric_sp.py"), "--out", str(out), "--devices",
                       str(devices), "--layouts", repr(layouts)], timeout=200, cwd=str(tmp_path), merge_stderr=True,
                      ranks=devices)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [json.loads((tmp_path / f"result.json.rank{r}").read_text()) for r in range(devices)]
    ref_losses, ref_norms, ref_state = _reference()
    for name, _, _ in layouts:
        for row in (rank[name] for rank in ranks):
            assert row["sp"] == 2 and row["widths"] == [8], row["widths"]  # half of seq_len 16 on each rank
            assert max(abs(a - b) for a, b in zip(row["losses"], ref_losses)) < 1e-10, (name, row["losses"])
            assert max(abs(a - b) for a, b in zip(row["norms"], ref_norms)) < 1e-10, (name, row["norms"])
            state = {k: torch.tensor(v, dtype=torch.float64) for k, v in row["state"].items()}
            worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
            assert worst < 1e-10, (name, worst)


# ------------------------------------------------------------------------------------------------ universal format
@pytest.mark.timeout(420)
def test_universal_checkpoint_sp2_to_sp1_and_back(tmp_path):
    """checkpoint_format="universal" under sp=2 (ZeRO-3 over dp x sp): its step-2 checkpoint resumes on one rank
    (sp=1), whose own step-4 checkpoint resumes at sp=2 again; every resumed loss equals the uninterrupted sp=2 run's
    (float32, 1e-5)."""
    from lightning_scale.checkpoint import dcp_format
    from test_universal_checkpoint import _close
    from test_universal_checkpoint import fit as fit_universal

    sp2 = ["--devices", "2", "--option", "stage=3", "--option", "sp=2"]
    full = fit_universal(tmp_path, "sp2", *sp2, "--ckpt-dir", str(tmp_path / "ckpt"))
    assert len(full["losses"]) == 6
    step2 = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    layout = dcp_format.open_checkpoint(str(step2))[1]["layout"]
    assert layout["stage"] == 3 and layout["sp"] == 2 and layout["dp"] == 1, layout
    one = fit_universal(tmp_path, "sp1", "--devices", "1", "--option", "stage=3", "--ckpt-dir", str(tmp_path / "ckpt1"),
                        "--resume", str(step2))
    assert one["world"] == 1
    _close(one["losses"], full["losses"][2:])
    back = fit_universal(tmp_path, "sp2_again", *sp2, "--resume", str(tmp_path / "ckpt1" / "epoch=1-step=4.ckpt"))
    _close(back["losses"], full["losses"][4:])


# ------------------------------------------------------------------------------------------------ sp x tp, sp x pp
@pytest.mark.timeout(300)
@pytest.mark.parametrize("other", ["tp=2", "pp=2"])
def test_trainer_sp2_with_tp2_or_pp2_matches_single_process(tmp_path, other):
    """Zero3DStrategy(sp=2, tp=2) and (sp=2, pp=2) on 4 CPU ranks (dp = 1; ZeRO-1): float32 training losses within
    1e-5 of the single-process run (gradient accumulation 2; SGD without clipping, so a gradient off by a factor
    shows, which AdamW's scale invariance or a clipped norm would hide)."""
    extra = ["--option", "microbatches=2"] if other.startswith("pp") else []
    common = ["--steps", "4", "--accumulate", "2", "--optimizer", "sgd", "--no-predict"]  # no clipping: it would
    single = fit(tmp_path, "single_sgd", "--strategy", "single", "--devices", "1", *common)  # hide the scale too
    run = fit(tmp_path, other.replace("=", ""), "--devices", "4", "--option", "sp=2", "--option", other,
              "--option", "stage=1", *extra, *common)
    assert run["world"] == 4 and len(run["losses"]) == len(single["losses"]) == 8
    diff = max(abs(a - b) for a, b in zip(run["losses"], single["losses"]))
    assert diff < 1e-5, (run["losses"], single["losses"])


# ------------------------------------------------------------------------------------------------ padded dict batches
@pytest.mark.timeout(300)
def test_trainer_sp2_padded_dict_batches_match_one_process(tmp_path):
    """test_hf_dict_batches' padded ``{input_ids, attention_mask, labels}`` batches (left and right padding) on an
    unchanged LlamaForCausalLM, through a real Trainer at sp=2 (ZeRO-3, SGD: the gradient's scale shows): each rank
    holds half of every row and of its mask; per-step losses equal ``model(**batch).loss`` in one process (1e-5)."""
    import json
    import sys

    import torch

    pytest.importorskip("transformers")
    from lightning_scale.testing import run_script
    from test_frozen_base import _module
    from test_hf_strict_load import HF_PRELOAD, SCRIPT

    H = _module()
    model = H.llama(attn="sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref = []
    for batch in torch.utils.data.DataLoader(H.dict_batches(), batch_size=H.BATCH):
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    args = ["--dict", "--attn", "sdpa", "--devices", "2", "--option", "sp=2", "--option", "stage=3"]
    proc = run_script([sys.executable, SCRIPT, "--out-dir", str(tmp_path), *args], timeout=240, cwd=tmp_path,
                      ranks=2, preload=HF_PRELOAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads((tmp_path / "info.json").read_text())["losses"]
    assert len(got) == len(ref) and max(abs(a - b) for a, b in zip(got, ref)) < 1e-5, (got, ref)
