"""The benchmarks' ``--plot PATH``: bench/common.write_plot -> lightning_scale.plot.plot_ratios draws, per system, the
median over rounds of its ratio to the baseline measured in the same round (min-max whiskers)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bars_are_the_median_same_round_ratios(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from common import ratio_table, round_ratios
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    from lightning_scale.plot import plot_ratios

    rounds = [{"ddp": {"tokens_per_s": 100.0}, "ls_z2": {"tokens_per_s": 95.0}, "fsdp2": {"tokens_per_s": 80.0}},
              {"ddp": {"tokens_per_s": 200.0}, "ls_z2": {"tokens_per_s": 210.0}, "fsdp2": {"tokens_per_s": 150.0}},
              {"ddp": {"tokens_per_s": 50.0}, "ls_z2": {"tokens_per_s": 49.0}}]  # fsdp2 did not run in round 2
    ratios = round_ratios(rounds, "ddp")
    assert ratios == {"ddp": [1.0, 1.0, 1.0], "ls_z2": [0.95, 1.05, 0.98], "fsdp2": [0.8, 0.75]}
    path = str(tmp_path / "fig" / "zero.png")
    drawn = plot_ratios(ratios, path, title="t", baseline="ddp", targets={"ls_z2": 0.97})
    assert drawn == {"ddp": (1.0, 1.0, 1.0), "ls_z2": (0.98, 0.95, 1.05), "fsdp2": (0.775, 0.75, 0.8)}
    assert os.path.getsize(path) > 5000
    # the same medians the printed table reports
    table = ratio_table([{k: dict(v, state_mb=0, peak_rss_mb=0) for k, v in r.items()} for r in rounds], "ddp")
    assert "| ls_z2 | 0.98 (0.95-1.05)" in table and "| fsdp2 | 0.78 (0.75-0.80)" in table, table
    with pytest.raises(ValueError):
        plot_ratios({"ddp": []}, path, title="t", baseline="ddp")
