"""``AutoModelForCausalLM.from_pretrained(dir)`` inside ``configure_model``, unchanged, under a real Trainer.

``fit_pretrained.py``'s LightningModule is the one-device version. Under ``Zero3DStrategy(stage=3)`` (2 ranks) its
``configure_model`` runs on the meta device: the call builds the model from the directory's config and each rank
reads only its shards from the safetensors files. A tiny float32 Llama saved with ``save_pretrained``, weights
scaled: the 3 per-step losses equal the single-device run (transformers' own ``from_pretrained``) within 1e-5; the
zero3 run built on meta (the directory was recorded as the weight source), the single-device one did not.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from lightning_scale.testing import run_script
from test_zero_trainer import script_ranks

SCRIPT = os.path.join(os.path.dirname(__file__), "fit_pretrained.py")


def _fit(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), *args], timeout=240, cwd=tmp_path,
                      ranks=script_ranks(args))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.02)
    directory = tmp_path_factory.mktemp("pretrained_trainer") / "llama"
    model.save_pretrained(directory)
    return str(directory)


@pytest.mark.timeout(300)
def test_from_pretrained_in_configure_model_under_zero3_matches_one_device(tmp_path, llama_dir):
    directory = llama_dir
    ref = _fit(tmp_path, "single", "--dir", directory, "--strategy", "single", "--devices", "1")
    run = _fit(tmp_path, "zero3", "--dir", directory, "--option", "stage=3")
    assert run["world"] == 2 and len(run["losses"]) == len(ref["losses"]) == 3
    assert run["recorded"] and not ref["recorded"]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) < 1e-5, (run["losses"], ref["losses"])


@pytest.fixture(scope="module")
def llama64_dir(tmp_path_factory, llama_dir):
    """The same weights saved in float64 (from_pretrained then builds in float64: exact parity is checkable)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).double()
    directory = tmp_path_factory.mktemp("pretrained_trainer64") / "llama"
    model.save_pretrained(directory)
    return str(directory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["stage=3", "tp=2"])
def test_from_pretrained_in_fabric_init_module_matches_one_device(tmp_path, llama64_dir, layout):
    """Fabric: ``from_pretrained`` inside ``init_module(empty_init=True)`` builds on meta at ZeRO-3 and at tp=2,
    ``fabric.setup`` reads each rank's shard / slices; float64 losses equal one process's within 1e-10."""
    run = _fit(tmp_path, "fabric", "--dir", llama64_dir, "--fabric", "--option", layout, "--precision", "64-true")
    assert run["world"] == 2 and run["recorded"] and run["meta"] and run["dtype"] == "torch.float64", run
    ref = _one_process_losses(llama64_dir, len(run["losses"]))
    assert max(abs(a - b) for a, b in zip(run["losses"], ref)) < 1e-10, (run["losses"], ref)


def _one_process_losses(directory, steps):
    """transformers' own from_pretrained, the script's rows and SGD, in this process (float64 kept)."""
    import transformers
    from fit_pretrained import _rows

    from lightning_scale.models.gpt import lm_loss

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in _rows(steps):
        loss = lm_loss(model(input_ids=x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
