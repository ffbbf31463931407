"""``python -m lightning_scale.checkpoint``: inspect / consolidate / export-hf on both folder formats.

In-process through ``cli.main`` (cheap), plus one fresh interpreter that imports the CLI and runs ``inspect``: it
must not import Lightning or Triton; its start-up time is printed (not asserted: the machine is shared).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from lightning_scale.checkpoint import dcp_format
from lightning_scale.checkpoint.cli import main
from lightning_scale.checkpoint.layout import flat_piece, tensor_piece


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 5, generator=g), torch.randn(5, generator=g)
    master = w.double()
    flat = w.reshape(-1).clone()
    pieces = [flat_piece("model/net.w", flat[:13], (6, 5), 0), flat_piece("model/net.w", flat[13:], (6, 5), 13),
              tensor_piece("model/net.b", b), tensor_piece("master/net.w", master),
              tensor_piece("optim/net.w/step", torch.tensor(4.0))]
    new = str(root / "new.ckpt")
    dcp_format.save(new, pieces, {"loops": {"global_step": 4}}, meta={"step": 4, "layout": {"dp": 2, "stage": 2}})
    from test_checkpoint_dcp import (
        _old_format_folder,  # tests/dist is on sys.path (conftest)
    )

    old = str(root / "old.ckpt")
    _old_format_folder(old, {"state_dict": {"net.w": w, "net.b": b}, "global_step": 4})
    cfg = root / "hfcfg"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return {"root": root, "new": new, "old": old, "w": w, "b": b, "master": master, "cfg": str(cfg)}


def test_inspect_both_formats(folders, capsys):
    assert main(["inspect", folders["new"]]) == 0
    out = capsys.readouterr().out
    assert f"format dcp (version {dcp_format.FORMAT_VERSION}), step 4, world size 1, " + "layout {'dp': 2, 'stage': 2}" in out
    assert "model/net.w" in out and "[6, 5]" in out and "4 chunk(s)" in out and "extra/loops" in out
    assert "__0_0.distcp" in out and "crc32" in out and ".metadata" in out
    assert main(["inspect", folders["old"]]) == 0
    out = capsys.readouterr().out
    assert "format sharded (version 2), step 4" in out and "net.w" in out and "checkpoint.pt" in out


def test_consolidate_both_formats(folders, tmp_path):
    assert main(["consolidate", folders["new"], str(tmp_path / "new.pt"), "--dtype", "keep"]) == 0
    sd = torch.load(str(tmp_path / "new.pt"))
    assert sorted(sd) == ["net.b", "net.w"]
    assert sd["net.w"].dtype == torch.float64 and torch.equal(sd["net.w"], folders["master"])  # fp32+ masters win
    assert torch.equal(sd["net.b"], folders["b"])
    assert main(["consolidate", folders["old"], str(tmp_path / "old.pt"), "--strip-prefix", "net."]) == 0
    sd = torch.load(str(tmp_path / "old.pt"))
    assert torch.equal(sd["w"], folders["w"]) and torch.equal(sd["b"], folders["b"])


def test_export_hf_and_errors(folders, tmp_path, capsys):
    from safetensors.torch import load_file

    out = str(tmp_path / "hf")
    assert main(["export-hf", folders["new"], out, "--config", folders["cfg"], "--strip-prefix", "net.",
                 "--dtype", "float32", "--max-shard-size", "64"]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert sorted(index["weight_map"]) == ["b", "w"] and len(set(index["weight_map"].values())) == 2
    tensors = {}
    for f in set(index["weight_map"].values()):
        tensors.update(load_file(os.path.join(out, f)))
    assert torch.equal(tensors["w"], folders["w"]) and torch.equal(tensors["b"], folders["b"])
    assert json.load(open(os.path.join(out, "config.json"))) == {"model_type": "toy"}
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "is not a checkpoint folder" in capsys.readouterr().err


def test_fresh_interpreter_imports_neither_lightning_nor_triton(folders):
    code = ("import sys, time; t = time.perf_counter(); from lightning_scale.checkpoint.cli import main; "
            f"rc = main(['inspect', {folders['new']!r}]); "
            "print('RESULT', rc, 'lightning' in sys.modules, 'triton' in sys.modules, time.perf_counter() - t)")
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "LIGHTNING_SCALE_SKIP_REGISTER"})
    wall = time.perf_counter() - start
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT"))
    _, rc, has_lightning, has_triton, took = line.split()
    print(f"inspect in a fresh interpreter: {float(took):.2f} s from import to output, {wall:.2f} s wall")
    assert (rc, has_lightning, has_triton) == ("0", "False", "False"), res.stderr


def test_inspect_reads_summary_json_and_falls_back_when_it_does_not_match(folders, tmp_path, capsys):
    """``inspect`` prints the same from summary.json (no torch) as from the folder itself; a folder without the
    summary (saved before it existed) reads as before; a truncated shard is named, not hidden by the summary."""
    import shutil

    from lightning_scale.checkpoint import cli

    for name in ("new", "old"):
        path = str(tmp_path / f"{name}.ckpt")
        shutil.copytree(folders[name], path)
        assert cli._read_summary(path) is not None, name  # written by folder.commit
        with_torch = cli._describe_with_torch(path)
        assert cli.describe(path) == with_torch, name
        assert main(["inspect", path]) == 0
        printed = capsys.readouterr().out
        os.remove(os.path.join(path, cli.SUMMARY))
        assert cli._read_summary(path) is None
        assert main(["inspect", path]) == 0
        assert capsys.readouterr().out == printed, name
    path = str(tmp_path / "cut.ckpt")
    shutil.copytree(folders["new"], path)
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1)
    assert main(["inspect", path]) == 2
    assert f"{shard} is truncated or corrupt" in capsys.readouterr().err
