"""The data contract (issue 14, item 6): tp / sp / pp peers read the same batch, or every rank says so by name.

Trainer runs on 2 CPU ranks (``fit_data_contract.py``): a loader that shards by global rank under tp=2, sp=2 and
pp=2 ends with :class:`BatchMismatchError` on both ranks at the first batch (no gloo size mismatch, no
hang); a loader that agrees on the first two batches and differs later is caught at its third batch only
in debug mode. The checksum itself is checked in-process.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from lightning_scale.diagnostics.batch_check import batch_checksum
from lightning_scale.testing import run_script

SCRIPT = os.path.join(os.path.dirname(__file__), "fit_data_contract.py")


def _run(tmp_path, *args):
    out = tmp_path / "out"
    out.mkdir()
    proc = run_script([sys.executable, SCRIPT, "--out-dir", str(out), *args], timeout=120, cwd=tmp_path, ranks=2)
    results = {}
    for r in (0, 1):
        path = out / f"rank{r}.json"
        assert path.exists(), (f"rank {r} wrote nothing (rc {proc.returncode})", proc.stdout[-3000:],
                               proc.stderr[-5000:])
        results[r] = json.loads(path.read_text())
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["tp=2", "pp=2", "sp=2"])
def test_peers_with_different_batches_raise_the_named_error_on_every_rank(tmp_path, layout):
    results = _run(tmp_path, "--shard", "global", "--option", layout)
    axis = layout.split("=")[0]
    for r, res in results.items():
        assert not res["ok"] and res["type"] == "BatchMismatchError", (r, res)
        msg = res["message"]
        assert msg.startswith(f"{axis} peers received different batches at step 0 (train batch 0): rank 0 checksum")
        assert "rank 1 checksum" in msg and "use strategy.dp_rank/dp_size" in msg, msg
    assert results[0]["message"] == results[1]["message"]


@pytest.mark.timeout(180)
def test_debug_mode_checks_every_batch(tmp_path):
    results = _run(tmp_path, "--shard", "late", "--option", "tp=2", "--debug")
    for r, res in results.items():
        assert not res["ok"] and res["type"] == "BatchMismatchError", (r, res)
        assert "at step 2 (train batch 2)" in res["message"], res["message"]


@pytest.mark.timeout(180)
def test_peers_that_follow_the_contract_train_and_see_the_grid(tmp_path):
    """Without debug mode only the first batch is checked: the late split trains (the cheap check's limit)."""
    results = _run(tmp_path, "--shard", "late", "--option", "tp=2")
    assert results[0] == {"ok": True, "dp": [0, 1, 0, 2, 0, 1, 0, 1]}, results[0]
    assert results[1] == {"ok": True, "dp": [0, 1, 1, 2, 0, 1, 0, 1]}, results[1]


def test_checksum_sees_values_order_shapes_and_dtypes():
    x = torch.arange(12).view(3, 4)
    base = batch_checksum((x, x + 1), torch.device("cpu"))
    assert torch.equal(base, batch_checksum((x.clone(), x + 1), torch.device("cpu")))
    variants = [
        (x.flip(0), x + 1),  # same rows, other order
        (x.view(4, 3), x + 1),  # same values, other shape
        (x.to(torch.int32), x + 1),  # other dtype
        (x + 1, x),  # tensors swapped
        (x, x + 1, x),  # one more tensor
    ]
    f = torch.arange(8, dtype=torch.float32)
    g = f.clone()
    g[3] = torch.nextafter(g[3], torch.tensor(10.0))  # one ulp
    for v in variants:
        assert not torch.equal(base, batch_checksum(v, torch.device("cpu"))), v
    assert not torch.equal(batch_checksum(f, torch.device("cpu")), batch_checksum(g, torch.device("cpu")))
    d1 = {"input_ids": x, "labels": x + 1}
    d2 = {"labels": x + 1, "input_ids": x}  # key order does not matter
    assert torch.equal(batch_checksum(d1, torch.device("cpu")), batch_checksum(d2, torch.device("cpu")))
