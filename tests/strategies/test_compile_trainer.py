"""Zero3DStrategy(compile=...) through the Trainer (issue 17, item 1): the project GPT's blocks compiled per unit
give the eager run's per-step losses (float32, 1e-5) and validation loss, at ZeRO 0, 2 and 3 (with gradient
accumulation and clipping, as the other Trainer parity tests), ZeRO-3 + optimizer offload, tp=2 and pp=2; no graph
is compiled after step 2 (the strategy's compile report, lightning_scale/strategies/compile_glue.py, counts them
as tests/dist/test_compile.py does), and rank 0 prints the report after step 1 (graphs, graph breaks) and at the end.
``aot_eager`` (Dynamo + AOTAutograd): the capture path without inductor's C++ build time; inductor's own numerics
are tests/dist/test_compile.py's."""

import json
import sys

import pytest

from lightning_scale.testing import run_script
from test_zero_trainer import COMMON, SCRIPT, fit

AOT = "compile={'backend': 'aot_eager'}"
LAYOUTS = {
    "zero0": ["stage=0"],
    "zero2": ["stage=2"],
    "zero3": ["stage=3"],
    "zero3_offload": ["stage=3", "offload='optimizer'"],
    "tp2": ["tp=2", "stage=1"],
    "pp2": ["pp=2", "microbatches=4"],
}


def _fit_with_stdout(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), *args], timeout=240, cwd=tmp_path, ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_compiled_trainer_losses_equal_eager(tmp_path, single, layout):
    """Compiled at each layout == the one-process eager run (the session's ``single``: plain Lightning, one device,
    the same COMMON settings) within 1e-5, per step and in validation: each layout's eager run equals that run in
    its own parity test (test_zero_trainer.py, test_tp_trainer.py, test_pipeline_trainer.py, ...), so one shared
    reference replaces an eager launch per layout (the suite's time). At ZeRO 0 the strategy's eager run is made as
    well: no compile report (and no callback) when nothing is compiled."""
    opts = [a for o in layout for a in ("--option", o)]
    compiled, stdout = _fit_with_stdout(tmp_path, "compiled", "--devices", "2", *COMMON, *opts, "--option", AOT)
    assert len(compiled["losses"]) == len(single["losses"]) == 8
    diff = max(abs(a - b) for a, b in zip(compiled["losses"], single["losses"]))
    assert diff < 1e-5, (compiled["losses"], single["losses"])
    assert abs(compiled["val"][0]["val_loss"] - single["val"][0]["val_loss"]) < 1e-5
    if layout == ["stage=0"]:
        eager = fit(tmp_path, "eager", "--devices", "2", *COMMON, *opts)
        assert max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"])) < 1e-5
        assert eager["compile"] is None  # no report (and no callback) when nothing is compiled
    report = compiled["compile"]
    assert report["step1"]["graphs"] > 0, report  # the units ran compiled in step 1
    assert report["steps"] == 4 and report["recompiles"] == 0, report  # nothing compiled after step 2
    first = [line for line in stdout.splitlines() if line.startswith("[lightning_scale compile] after step 1:")]
    assert len(first) == 1, stdout[-3000:]  # rank 0 only, once
    assert f"{report['step1']['graphs']} graphs compiled, {report['step1']['graph_breaks']} graph breaks" in first[0]
    assert "(recompiles): 0" in stdout


@pytest.mark.parametrize("layout", [["stage=2"], ["stage=3"], ["tp=2", "stage=1"], ["pp=2", "microbatches=2"]],
                         ids=["zero2", "zero3", "tp2", "pp2"])
def test_compiled_checkpoint_resume_gives_identical_losses(tmp_path, layout):
    """Issue 17 item 5, the resume test with compile on: a compiled run saves after step 2; a compiled run resumed from
    it trains steps 3-6 with the uninterrupted compiled run's losses, bit for bit (bf16-mixed, accumulation, clipping,
    as tests/strategies/test_zero_trainer.py's eager resume test), and (ZeRO-2; the other layouts' compiled = eager
    in test_compiled_trainer_losses_equal_eager, for the suite's time) the eager run's within 1e-5."""
    args = ["--devices", "2", "--steps", "6", "--accumulate", "2", "--clip", "0.5", "--epoch-batches", "4",
            "--precision", "bf16-mixed", *[a for o in layout for a in ("--option", o)]]
    ckpt = tmp_path / "ckpt"
    full = fit(tmp_path, "full", *args, "--option", AOT, "--ckpt-dir", str(ckpt))
    resumed = fit(tmp_path, "resumed", *args, "--option", AOT, "--resume", str(ckpt / "epoch=0-step=2.ckpt"))
    assert len(resumed["losses"]) == 8  # the micro-batches of steps 3-6
    assert resumed["losses"] == full["losses"][4:]
    if layout == ["stage=2"]:  # bf16-mixed with accumulation and clipping, compiled vs eager
        eager = fit(tmp_path, "eager", *args)
        assert max(abs(a - b) for a, b in zip(full["losses"], eager["losses"])) < 1e-5, (full["losses"],
                                                                                          eager["losses"])
    # the resumed run counts its own steps: its first compile is not taken for recompiles (it was: 2)
    report = resumed["compile"]
    assert report["steps"] == 6 and report["run_steps"] == 4 and report["recompiles"] == 0, report
