"""bench/gpu_experts.py (prepared for a lent GPU) runs its code on CPU: one tp rank's experts split and placed, through
the package's own split_experts / place_experts, forward + backward, a table row per tp. Nothing is asserted on
time; the row must have both timings and their ratio."""

from __future__ import annotations

import os
import re
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def test_the_gpu_experts_script_runs_on_cpu(capsys):
    pytest.importorskip("transformers")
    sys.path.insert(0, BENCH)
    try:
        import gpu_experts
    finally:
        sys.path.remove(BENCH)
    assert gpu_experts.main(["--device", "cpu", "--preset", "tiny", "--tp", "2", "4", "--reps", "1", "--dtype",
                             "float32", "--impl", "batched_mm"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 2, rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(re.fullmatch(r"[0-9.]+", c) for c in cells[2:5]), row  # split ms, placed ms, ratio
