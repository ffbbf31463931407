"""A frozen base with trainable adapters (issue 14, item 4, second half), through a real Trainer at ZeRO 1-3.

An unchanged tiny ``LlamaForCausalLM`` is frozen and gets hand-written low-rank adapters on every q_proj / v_proj
(``fit_hf_state.LoRALinear``: 1,792 trainable elements beside 43,360 frozen ones); the optimizer (Adam) is handed
every parameter, frozen ones included. On 2 ranks: per-step losses equal one process (float64); the engine
holds optimizer state (and, in bf16-mixed, fp32 master copies) for its share of the adapters only; and the
collectives move the adapters' gradients (and, at stages 1-3, their parameters) only: counted through the
``CommCounter`` from the first step to the last, against the ZeRO formulas for the adapter bytes alone.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from lightning_scale.testing import run_script
from test_hf_strict_load import HF_PRELOAD, SCRIPT

N = 2  # ranks = dp


def _module():
    sys.path.insert(0, os.path.dirname(__file__))
    import fit_hf_state

    return fit_hf_state


@pytest.fixture(scope="module")
def reference():
    """(per-step losses of one process, trainable elements, frozen elements)."""
    pytest.importorskip("transformers")
    from lightning_scale.models.gpt import lm_loss

    H = _module()
    model = H.LlamaModule(optimizer="adam", lora=True).model
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for xb, yb in torch.utils.data.DataLoader(H.batches(), batch_size=H.BATCH):
        loss = lm_loss(model(input_ids=xb).logits, yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return losses, trainable, frozen


def _close(measured: float, expected: float, what: str) -> None:
    assert expected > 0 and abs(measured - expected) <= 0.05 * expected, (what, measured, expected)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,precision", [(1, "64-true"), pytest.param(2, "64-true", marks=pytest.mark.slow),
                                             (3, "64-true"), (1, "bf16-mixed"), (3, "bf16-mixed")])
def test_frozen_base_takes_no_state_and_no_traffic(tmp_path, reference, stage, precision):
    ref_losses, trainable, frozen = reference
    args = ["--devices", str(N), "--optimizer", "adam", "--lora", "--option", f"stage={stage}",
            "--precision", precision]
    proc = run_script([sys.executable, SCRIPT, "--out-dir", str(tmp_path), *args], timeout=240, cwd=tmp_path,
                      ranks=N, preload=HF_PRELOAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    info = json.loads((tmp_path / "info.json").read_text())
    steps = len(ref_losses)
    if precision == "64-true":  # bf16-mixed runs check the bytes only
        assert max(abs(a - b) for a, b in zip(info["losses"], ref_losses)) < 1e-12, (info["losses"], ref_losses)
    size = 8 if precision == "64-true" else 2  # parameter / gradient bytes per element
    (mem,) = info["memory"]  # one optimizer -> one engine
    share = trainable / N  # this rank's adapter elements
    _close(mem["optimizer_state"], 2 * share * (8 if precision == "64-true" else 4), "Adam state: adapters only")
    if precision == "64-true":
        assert mem["master"] == 0, mem  # the float64 parameters are their own masters
    else:
        _close(mem["master"], 4 * share, "fp32 masters: adapters only")
    comm = info["comm"]
    # gradients: one reduce-scatter of the adapters per step; parameters: one all-gather per step at stages 1-2,
    # two at stage 3 (forward and backward; the forward's last unit once from step 2, when the order is known: it
    # stays gathered for its backward); the frozen base (24x larger) moves nothing
    ring = (N - 1) / N * trainable * size * steps
    _close(comm["reduce_scatter"], ring, "gradient reduce-scatter")
    if stage == 3:
        last = _module().LlamaModule(optimizer="adam", lora=True).model.model.layers[-1]
        kept = (N - 1) / N * sum(p.numel() for p in last.parameters() if p.requires_grad) * size * (steps - 1)
        _close(comm["all_gather"], 2 * ring - kept, "parameter all-gather")
    else:
        _close(comm["all_gather"], ring, "parameter all-gather")
    rest = sum(v for k, v in comm.items() if k not in ("reduce_scatter", "all_gather"))
    assert rest <= 16 * steps, comm  # the one-flag non-finite vote per step
    assert comm["reduce_scatter"] < (N - 1) / N * frozen * size / 10  # far from even one step of the base


@pytest.mark.timeout(300)
def test_frozen_base_with_adapters_at_tp2(tmp_path, reference):
    """tp=2 (dp=1) with a plan for the adapters (``fit_hf_state.LORA_TP_PLAN``; the model's own tp_plan is refused by
    name: q_proj is a LoRALinear): losses equal one process; Adam state only for this rank's adapter slices."""
    ref_losses, trainable, _ = reference
    args = ["--devices", "2", "--optimizer", "adam", "--lora", "--option", "tp=2", "--option", "stage=1"]
    proc = run_script([sys.executable, SCRIPT, "--out-dir", str(tmp_path), *args], timeout=240, cwd=tmp_path,
                      ranks=2, preload=HF_PRELOAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    info = json.loads((tmp_path / "info.json").read_text())
    assert max(abs(a - b) for a, b in zip(info["losses"], ref_losses)) < 1e-12, (info["losses"], ref_losses)
    (mem,) = info["memory"]
    _close(mem["optimizer_state"], 2 * 8 * trainable / 2, "Adam state: this rank's adapter slices")
