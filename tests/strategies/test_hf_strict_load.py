"""Consolidated state = the model's own ``state_dict()`` (issue 14, item 5), in every mode.

An unchanged tiny ``LlamaForCausalLM`` (float64, vocabulary 97 so tp=2 cannot split it evenly, tied and untied
head) is trained 2 steps through a real Trainer (``fit_hf_state.py``) under ZeRO 1-3, offload, tp, pp, tp x
ZeRO-3 and dp x tp x pp; its state is then taken three ways: ``strategy.full_state_dict()``,
``strategy.lightning_module_state_dict()`` (not at ZeRO-3, where it is the checkpoint's part beside the
per-rank shards) and the consolidation CLI on the saved checkpoint. Each must have exactly the keys and
shapes of a fresh model's ``state_dict()`` (persistent buffers only: no ``rotary_emb.inv_freq``; no
vocabulary padding; a tied ``lm_head.weight`` present), load with ``strict=True`` into a fresh
``LlamaForCausalLM`` and give the logits of the same model trained in this process (within 1e-10).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from lightning_scale.testing import SCRIPT_PRELOAD, run_script

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "fit_hf_state.py")
# The ranks fork from a process that imported transformers' Llama too (1-2 s of CPU per rank otherwise).
HF_PRELOAD = (*SCRIPT_PRELOAD, "transformers", "transformers.models.llama.modeling_llama")

# name -> (Zero3DStrategy options, ranks, optimizer, tied head)
MODES = {
    "zero1": (["stage=1"], 2, "sgd", False),
    "zero2": (["stage=2"], 2, "sgd", False),
    "zero3-tied": (["stage=3"], 2, "sgd", True),
    "zero2-offload": (["stage=2", "offload=optimizer"], 2, "adam", False),
    "zero3-offload": (["stage=3", "offload=all"], 2, "adam", False),
    "tp2": (["tp=2"], 2, "sgd", False),
    "tp2-tied": (["tp=2"], 2, "sgd", True),
    "pp2": (["pp=2", "microbatches=2"], 2, "sgd", False),
    "tp2-zero3-tied": (["tp=2", "stage=3"], 4, "sgd", True),
    "pp2-zero3": (["pp=2", "stage=3", "microbatches=2"], 4, "sgd", False),
    "dp2-tp2-pp2": (["tp=2", "pp=2", "stage=1", "microbatches=2"], 8, "sgd", False),
}
# the same code paths as a case beside them (suite time): zero1/2 = the module's own state_dict, pp2 and tp2 within
# dp2-tp2-pp2, tp2 x ZeRO-3 = ZeRO-3 merged over tp
SLOW = {"zero1", "zero2", "zero2-offload", "tp2", "pp2", "tp2-zero3-tied", "pp2-zero3"}


def _module():
    sys.path.insert(0, HERE)
    import fit_hf_state

    return fit_hf_state


@pytest.fixture(scope="module")
def reference():
    """(optimizer, tied) -> the logits on a fixed input of the model trained in this process, plus the input."""
    pytest.importorskip("transformers")
    from lightning_scale.models.gpt import lm_loss

    H = _module()
    x = torch.randint(0, H.VOCAB, (2, H.SEQ), generator=torch.Generator().manual_seed(5))
    out = {}
    for optimizer, tied in {(m[2], m[3]) for m in MODES.values()}:
        model = H.llama(tied=tied)
        opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if optimizer == "adam"
               else torch.optim.SGD(model.parameters(), lr=0.5))
        for xb, yb in torch.utils.data.DataLoader(H.batches(), batch_size=H.BATCH):
            lm_loss(model(input_ids=xb).logits, yb).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            out[optimizer, tied] = model(input_ids=x).logits
    return x, out


def _check(state, tied, x, ref, source):
    H = _module()
    state = {k[len("model."):]: v for k, v in state.items()}  # LightningModule keys -> the model's
    fresh = H.llama(tied=tied)
    own = fresh.state_dict()
    assert sorted(state) == sorted(own), (source, sorted(set(state) ^ set(own)))
    bad = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in state.items() if v.shape != own[k].shape}
    assert not bad, (source, bad)
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        diff = (fresh(input_ids=x).logits - ref).abs().max().item()
    assert diff < 1e-10, (source, diff)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MODES])
def test_consolidated_state_loads_strictly_into_a_fresh_model(tmp_path, reference, mode):
    from lightning_scale.zero.state_dict import main as consolidate_cli

    options, ranks, optimizer, tied = MODES[mode]
    args = ["--devices", str(ranks), "--optimizer", optimizer] + (["--tied"] if tied else [])
    for o in options:
        args += ["--option", o]
    proc = run_script([sys.executable, SCRIPT, "--out-dir", str(tmp_path), *args], timeout=240, cwd=tmp_path,
                      ranks=ranks, preload=HF_PRELOAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    x, refs = reference
    ref = refs[optimizer, tied]
    _check(torch.load(tmp_path / "full.pt"), tied, x, ref, "full_state_dict")
    if "stage=3" not in options:
        _check(torch.load(tmp_path / "lm.pt"), tied, x, ref, "lightning_module_state_dict")
    assert consolidate_cli([str(tmp_path / "ckpt"), str(tmp_path / "cli.pt"), "--dtype", "keep"]) == 0
    _check(torch.load(tmp_path / "cli.pt"), tied, x, ref, "consolidation CLI")
