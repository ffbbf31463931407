"""Zero3DStrategy(compile=...) through the Trainer (issue 17, item 1): the project GPT's blocks compiled per unit
give the eager run's per-step losses (float32, 1e-5) and validation loss, at ZeRO-3 (with gradient accumulation
and clipping, as the other Trainer parity tests) and at tp=2.
``aot_eager`` (Dynamo + AOTAutograd): the capture path without inductor's C++ build time; inductor's own numerics
are tests/dist/test_compile.py's."""

import pytest

from test_zero_trainer import COMMON, fit

AOT = "compile={'backend': 'aot_eager'}"


@pytest.mark.parametrize("layout", [["stage=3"], ["tp=2", "stage=1"]], ids=["zero3", "tp2"])
def test_compiled_trainer_losses_equal_eager(tmp_path, layout):
    opts = [a for o in layout for a in ("--option", o)]
    eager = fit(tmp_path, "eager", "--devices", "2", *COMMON, *opts)
    compiled = fit(tmp_path, "compiled", "--devices", "2", *COMMON, *opts, "--option", AOT)
    assert len(compiled["losses"]) == len(eager["losses"]) == 8
    diff = max(abs(a - b) for a, b in zip(compiled["losses"], eager["losses"]))
    assert diff < 1e-5, (compiled["losses"], eager["losses"])
    assert abs(compiled["val"][0]["val_loss"] - eager["val"][0]["val_loss"]) < 1e-5
