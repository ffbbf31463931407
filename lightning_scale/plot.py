"""Plots of a training run from its logs: ``python -m lightning_scale.plot RUN_DIR``.

Reads every Lightning ``metrics.csv`` (CSVLogger) and TensorBoard event file (TensorBoardLogger) under
RUN_DIR and writes PNGs to ``RUN_DIR/plots/``:

* ``loss.png``        train_loss and val_loss against the optimizer step
* ``throughput.png``  tokens/s (``perf/tokens_per_sec``)
* ``memory.png``      resident memory of every rank (``memory/rank{r}_MiB``)
* ``loss_scale.png``  the fp16 dynamic loss scale (``perf/loss_scale``; only fp16 runs log it)

A figure whose metrics are absent is skipped. :func:`plot_ratios` draws a benchmark's ratios against its peers
(the ``--plot PATH`` option of ``bench/zero.py``, ``bench/tensor_parallel.py``, ``bench/models.py``). Needs matplotlib (``pip install matplotlib``, the ``plot``
extra); TensorBoard event files also need ``tensorboard``. Nothing here imports torch or Lightning.
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

Series = Dict[str, List[Tuple[float, float]]]  # metric name -> [(step, value)], sorted by step

# (file name, title, y label, metric names or a regex over them, log scale)
FIGURES = (
    ("loss.png", "loss", "cross-entropy (nats/byte)", ("train_loss", "val_loss"), False),
    ("throughput.png", "training throughput", "tokens/s (all ranks)", ("perf/tokens_per_sec",), False),
    ("memory.png", "resident memory per rank", "MiB", re.compile(r"memory/rank\d+_MiB"), False),
    ("loss_scale.png", "fp16 loss scale", "scale", ("perf/loss_scale",), True),
)


def _add(series: Series, name: str, step: float, value: float) -> None:
    if not math.isnan(value):
        series.setdefault(name, []).append((step, value))


def read_csv(path: str, series: Optional[Series] = None) -> Series:
    """Every numeric column of a Lightning metrics.csv, keyed by name, against its ``step`` column."""
    series = {} if series is None else series
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = float(row.get("step") or "nan")
            for name, text in row.items():
                if name in ("step", "epoch") or not text:
                    continue
                try:
                    _add(series, name, step, float(text))
                except ValueError:
                    continue
    return series


def read_tensorboard(path: str, series: Optional[Series] = None) -> Series:
    """Every scalar of one event file (or a folder of them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series = {} if series is None else series
    acc = EventAccumulator(path, size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    for tag in acc.Tags().get("scalars", []):
        for event in acc.Scalars(tag):
            _add(series, tag, float(event.step), float(event.value))
    return series


def read_run(run_dir: str) -> Series:
    """The metrics of every CSV and TensorBoard log under ``run_dir``, merged by name, sorted by step."""
    series: Series = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "**", "metrics.csv"), recursive=True)):
        read_csv(path, series)
    folders = {os.path.dirname(p) for p in glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"),
                                                     recursive=True)}
    for folder in sorted(folders):
        read_tensorboard(folder, series)
    for points in series.values():
        points.sort()
    return series


def _selected(series: Series, names) -> List[str]:
    if isinstance(names, re.Pattern):
        return sorted((n for n in series if names.fullmatch(n)), key=lambda n: int(re.sub(r"\D", "", n) or 0))
    return [n for n in names if n in series]


def plot_run(run_dir: str, out_dir: Optional[str] = None) -> Dict[str, Dict[str, Tuple[List[float], List[float]]]]:
    """Write the PNGs; returns {png path: {curve label: (steps, values) as drawn}}."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    series = read_run(run_dir)
    if not series:
        raise FileNotFoundError(f"{run_dir}: no metrics.csv or TensorBoard event file found")
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written: Dict[str, Dict[str, Tuple[List[float], List[float]]]] = {}
    for filename, title, ylabel, names, log in FIGURES:
        chosen = _selected(series, names)
        if not chosen:
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for name in chosen:
            steps, values = zip(*series[name])
            marker = "o" if len(steps) < 20 else None  # sparse curves (val_loss) stay visible
            ax.plot(steps, values, label=name, marker=marker)
        ax.set(title=f"{title}: {os.path.basename(os.path.abspath(run_dir))}", xlabel="step", ylabel=ylabel)
        if log:
            ax.set_yscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, filename)
        fig.savefig(path)
        written[path] = {line.get_label(): (list(map(float, line.get_xdata())), list(map(float, line.get_ydata())))
                         for line in ax.get_lines()}
        plt.close(fig)
    return written


def plot_ratios(ratios: Dict[str, Sequence[float]], path: str, *, title: str, baseline: str,
                targets: Optional[Dict[str, float]] = None) -> Dict[str, Tuple[float, float, float]]:
    """A benchmark's figure: one bar per system, the median over rounds of its ratio to ``baseline`` measured in the
    same round, with a min-max whisker; a dashed line at 1 (the baseline) and a tick per system's target.
    Used by the ``bench/*.py --plot PATH`` options. Returns {system: (median, min, max) as drawn}."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {name: (statistics.median(v), min(v), max(v)) for name, v in ratios.items() if v}
    if not drawn:
        raise ValueError(f"{path}: no ratios to plot")
    names = list(drawn)
    med = [drawn[n][0] for n in names]
    err = [[drawn[n][0] - drawn[n][1] for n in names], [drawn[n][2] - drawn[n][0] for n in names]]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 4), dpi=100)
    bars = ax.bar(range(len(names)), med, yerr=err, capsize=4, color="tab:blue", alpha=0.8)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"{baseline} = 1")
    for i, name in enumerate(names):
        if targets and name in targets:
            ax.plot([i - 0.4, i + 0.4], [targets[name]] * 2, color="tab:red", linewidth=2,
                    label="target" if i == min(j for j, n in enumerate(names) if n in targets) else None)
    for bar, m in zip(bars, med):
        ax.annotate(f"{m:.2f}", (bar.get_x() + bar.get_width() / 2, m), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set(title=title, ylabel=f"ratio vs {baseline} (median, min-max over rounds)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return drawn


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_scale.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run's output folder (examples/train.py prints it), searched recursively")
    ap.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    args = ap.parse_args(argv)
    try:
        written = plot_run(args.run_dir, args.out)
    except ImportError as err:
        print(f"error: {err.name or err} is not installed: pip install matplotlib tensorboard", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path, curves in written.items():
        print(f"wrote {path}: {', '.join(curves)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
