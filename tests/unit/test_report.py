"""The startup table is true (issue 18): real Trainer(strategy=Zero3DStrategy(...)) setups on 2 ranks, one per
stage / optimizer / precision / offload; the header's bytes equal the engines' measurement, the engines agree
with the estimate row of this run, and the header's totals equal the table's * row.

All setups run inside one run_distributed job (Lightning imported once per rank; each fit is one step).
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from lightning_scale.testing import run_distributed

COMBOS = [
    dict(stage=0), dict(stage=1), dict(stage=2), dict(stage=3),
    dict(stage=0, optimizer="onebit_adam"), dict(stage=1, optimizer="onebit_adam"),
    dict(stage=2, optimizer="sgd", attention="fixed"),  # (sparse attention fails under 16-mixed: reported)
    dict(stage=2, precision="bf16-mixed"), dict(stage=3, precision="16-mixed"),
    dict(stage=2, offload="optimizer"), dict(stage=3, offload="all"),
]
CATEGORIES = ("params", "grads", "master", "optimizer_state")


def _fits(rank, world_size, combos):
    import logging
    import warnings

    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl

    from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule
    from lightning_scale.models.gpt import GPTConfig
    from lightning_scale.nn import FixedSparsityConfig
    from lightning_scale.strategies import Zero3DStrategy
    from lightning_scale.strategies import report

    out = []
    for combo in combos:
        c = dict(combo)
        optimizer, precision = c.pop("optimizer", "adamw"), c.pop("precision", "32-true")
        attention = FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2) if c.pop("attention", None) else None
        cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64)  # ~110k params
        module = GPTLightningModule(model=cfg, optimizer=optimizer, max_steps=1, attention=attention)
        data = ByteCorpusDataModule(seq_len=32, batch_size=2, source="random", vocab_size=64, random_length=64)
        strategy = Zero3DStrategy(precision=precision, **c)
        captured = {}
        original = report.layout_table

        def layout_table(s, _captured=captured):  # the table as printed, and the numbers behind it, at setup
            _captured["measured"] = report.measured_bytes(s.engines)
            row = report._estimates(s)[1]
            _captured["row"] = {"device": row.device.as_dict(), "host": row.host.as_dict()}
            return original(s)

        trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, num_sanity_val_steps=0)
        buf = io.StringIO()
        report_module = __import__("lightning_scale.strategies.zero3d", fromlist=["layout_table"])
        report_module.layout_table = layout_table
        try:
            with contextlib.redirect_stdout(buf):
                trainer.fit(module, datamodule=data)
        finally:
            report_module.layout_table = original
        captured["text"] = buf.getvalue()
        out.append(captured)
    return out


@pytest.fixture(scope="module")
def tables():
    results = run_distributed(_fits, world_size=2, args=(COMBOS,), timeout=600)
    return dict(zip(map(repr, COMBOS), results[0]))  # rank 0 prints the table


def _header(text, label):
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(label))
    return [float(x) for x in re.findall(r"([\d.]+) MiB", line)]


def _star_row(text):
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("| *"))
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    return [0.0 if c == "-" else float(c) for c in cells[3:]]  # dev params ... transient, device/rank, host/rank


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_header_equals_table_and_engines(tables, combo):
    run = tables[repr(combo)]
    text, measured, row = run["text"], run["measured"], run["row"]
    assert "params / rank" in text and "| * |" in text, text  # the bytes lines are there (stage 0 + 1-bit too)
    # what the engines hold now is what the estimate says they hold (padding: < dp elements per bucket)
    for key in CATEGORIES:
        if measured[key]:
            expected = row["device"][key] + row["host"][key]
            assert abs(measured[key] - expected) <= 64, (key, measured[key], expected, text)
    # the header's totals are the * row's device/rank and host/rank columns, and its lines the row's columns
    device, host = _header(text, "device / rank (peak)")
    star = _star_row(text)
    assert (device, host) == (star[6], star[7]), text
    if not row["host"]["total"]:
        for i, label in enumerate(("params / rank", "grads / rank", "fp32 master / rank", "optimizer state / rank")):
            assert _header(text, label)[0] == star[i], (label, text)


def test_header_shows_precision_attention_and_layout(tables):
    fp16 = tables[repr(dict(stage=3, precision="16-mixed"))]["text"]
    assert re.search(r"precision\s+16-mixed \(params/grads float16, float32 master, .*dynamic loss scale", fp16), fp16
    sparse = tables[repr(dict(stage=2, optimizer="sgd", attention="fixed"))]["text"]
    assert re.search(r"attention\s+FixedSparsityConfig \(block 16, seq 32\): \d+\.\d% of blocks", sparse), sparse
    dense = tables[repr(dict(stage=2, precision="bf16-mixed"))]["text"]
    assert re.search(r"precision\s+bf16-mixed \(params/grads bfloat16", dense) and re.search(r"attention\s+dense",
                                                                                             dense), dense
    onebit = tables[repr(dict(stage=0, optimizer="onebit_adam"))]["text"]
    assert re.search(r"optimizer\s+OneBitAdam in ", onebit), onebit
    assert "estimate: allocated by the first step" in onebit  # its m, v do not exist before the first step
