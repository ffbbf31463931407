"""Dict batches under pipeline parallelism (issue 14): ``{"input_ids", "attention_mask", "labels"}`` as Hugging Face
datasets give them, on an unchanged ``LlamaForCausalLM`` at pp=2, through a real Trainer.

The rows are padded on the left and on the right by different amounts, so the padding mask changes what real
tokens attend to and the micro-batches hold different numbers of label tokens. The pipeline glue splits the
dict into micro-batches with the mask travelling alongside, and takes the model's own loss normalized by the
whole batch's label tokens: per-step losses equal ``model(**batch).loss`` trained in one process. The loss is
float32 inside transformers (``logits.float()``) on both sides, hence 1e-5. Dropping the mask moves the
second loss by 2.9e-2, a per-micro-batch mean by 4.3e-3.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from lightning_scale.config import ConfigError
from lightning_scale.strategies.pipeline_glue import split_batch
from lightning_scale.testing import run_script
from test_hf_strict_load import HF_PRELOAD, SCRIPT
from test_frozen_base import _module


@pytest.mark.timeout(300)
def test_dict_batches_at_pp2_match_one_process(tmp_path):
    pytest.importorskip("transformers")
    H = _module()
    model = H.llama(attn="sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref = []
    for batch in torch.utils.data.DataLoader(H.dict_batches(), batch_size=H.BATCH):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    args = ["--dict", "--attn", "sdpa", "--devices", "2", "--option", "pp=2", "--option", "microbatches=2"]
    proc = run_script([sys.executable, SCRIPT, "--out-dir", str(tmp_path), *args], timeout=240, cwd=tmp_path,
                      ranks=2, preload=HF_PRELOAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads((tmp_path / "info.json").read_text())["losses"]
    assert len(got) == len(ref) and max(abs(a - b) for a, b in zip(got, ref)) < 1e-5, (got, ref)


def test_dict_batch_split():
    ids, mask = torch.arange(12).view(2, 6), torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    inputs, targets = split_batch({"input_ids": ids, "attention_mask": mask, "labels": ids})
    assert inputs.shape == (2, 2, 6) and torch.equal(inputs[:, 0], ids) and torch.equal(inputs[:, 1], mask)
    assert targets is ids
    inputs, targets = split_batch({"input_ids": ids})
    assert inputs is ids and targets is None
    with pytest.raises(ConfigError, match="'token_type_ids'"):
        split_batch({"input_ids": ids, "token_type_ids": ids})
    with pytest.raises(ConfigError, match="no 'input_ids'"):
        split_batch({"labels": ids})
