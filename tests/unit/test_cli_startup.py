"""The command-line tools start fast (issue 18): importing them pulls in neither Lightning nor triton, runpy
does not warn, and ``import lightning_scale`` still registers the strategies for Trainer users.

The start times are printed (``-s`` shows them), never asserted: the machine may be loaded.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

HEAVY = ("lightning", "lightning_fabric", "pytorch_lightning", "triton")


def _run(*args, timeout=120):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_cli_modules_do_not_import_lightning_or_triton():
    code = ("import sys, lightning_scale, lightning_scale.estimate, lightning_scale.zero.state_dict; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    proc, _ = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


@pytest.mark.parametrize("cli", [["lightning_scale.estimate", "--params", "13e9", "--dp", "8"],
                                 ["lightning_scale.zero.state_dict", "--help"]])
def test_cli_start_time_and_no_runpy_warning(cli):
    proc, seconds = _run("-m", *cli)
    print(f"\npython -m {' '.join(cli)}: {seconds:.2f} s wall (target <= 2 s on a quiet machine)")
    assert proc.returncode == 0, proc.stderr
    assert "found in sys.modules" not in proc.stderr, proc.stderr
    assert proc.stdout.strip(), "printed nothing"


def test_state_dict_cli_bad_folder_is_one_error_line(tmp_path):
    """Past argparse (torch imported, consolidate_checkpoint called): a folder that is not a checkpoint gives the
    CLI's own one-line error and exit code 2, no traceback, and no runpy warning."""
    proc, seconds = _run("-m", "lightning_scale.zero.state_dict", str(tmp_path / "missing"), str(tmp_path / "o.pt"))
    print(f"\npython -m lightning_scale.zero.state_dict MISSING OUT: {seconds:.2f} s wall")
    assert proc.returncode == 2, proc.stderr
    assert "found in sys.modules" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == f"error: {tmp_path / 'missing'} is not a sharded checkpoint folder"


def test_import_lightning_scale_then_lightning_registers_strategies():
    """The lazy path: lightning_scale first (no Lightning yet), then Lightning; Trainer resolves the name."""
    code = "\n".join([
        "import sys, lightning_scale",
        "assert 'lightning' not in sys.modules",
        "import lightning.pytorch as pl",
        "from lightning.pytorch.strategies import StrategyRegistry",
        "t = pl.Trainer(strategy='zero2', accelerator='cpu', devices=1, logger=False, enable_progress_bar=False)",
        "print(type(t.strategy).__name__, t.strategy.config.zero.stage, 'zero3_offload' in StrategyRegistry)",
    ])
    proc, _ = _run("-c", code, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == ["Zero3DStrategy", "2", "True"], proc.stdout


def test_import_after_lightning_registers_strategies():
    """The eager path, in this process: Lightning is imported (conftest / other tests), then the package."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_scale

    assert "zero1" in StrategyRegistry and StrategyRegistry["zero1"]["init_params"] == {"stage": 1}
    trainer = pl.Trainer(strategy="zero1", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, lightning_scale.Zero3DStrategy)
