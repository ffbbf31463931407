"""Shared helpers for the benchmarks: measurement inside a rank, and ratio tables across interleaved rounds."""

from __future__ import annotations

import gc
import resource
import statistics
from typing import Dict, Iterable, List, Sequence

import torch


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def live_tensor_mb(extra: Iterable[torch.Tensor] = ()) -> float:
    """MB of distinct storages of every tensor reachable from Python (params, grads, optimizer state...).

    The same measurement for every system, taken right after the optimizer step (activations freed).
    Buffers held only inside C++ (e.g. DDP's reducer buckets) are invisible to it; gradients that are
    views of those buckets are counted through ``param.grad``.
    """
    gc.collect()  # only what is still referenced counts
    seen, total = set(), 0
    tensors: List[torch.Tensor] = list(extra)
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj):
                tensors.append(obj)
                if obj.grad is not None:
                    tensors.append(obj.grad)
        except Exception:  # noqa: BLE001 - some objects raise on inspection
            continue
    from torch._subclasses.fake_tensor import FakeTensor

    for t in tensors:
        if isinstance(t, FakeTensor):  # torch.compile's tracing copies hold no memory
            continue
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except Exception:  # noqa: BLE001 - meta / sparse / wrapper (DTensor) tensors
            continue
        if key in seen or storage.device.type == "meta":
            continue
        seen.add(key)
        total += storage.nbytes()
    return total / 2**20


def ratio_table(rounds: Sequence[Dict[str, Dict[str, float]]], baseline: str, metric: str = "tokens_per_s",
                extra: Sequence[str] = ("state_mb", "peak_rss_mb")) -> str:
    """Median over rounds of each system's metric divided by the baseline's in the same round."""
    systems = list(rounds[0].keys())
    lines = [f"| system | {metric} ratio vs {baseline} (median) | {metric} (median) | "
             + " | ".join(extra) + " |", "|---" * (3 + len(extra)) + "|"]
    for name in systems:
        ratios = [r[name][metric] / r[baseline][metric] for r in rounds if name in r and baseline in r]
        values = [r[name][metric] for r in rounds if name in r]
        if not values:
            continue
        cols = [f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                f"{statistics.median(values):,.0f}"]
        cols += [f"{statistics.median(r[name][k] for r in rounds if name in r):,.1f}" for k in extra]
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def peer_table(rounds: Sequence[Dict[str, Dict[str, float]]], pairs: Sequence[tuple],
               failed: Dict[str, str] = None, metric: str = "tokens_per_s") -> str:
    """One row per (system, peer, target): median over rounds of system/peer in the same round, and peak RSS.

    ``pairs``: (system, peer, target ratio or None). A peer that failed or did not run is listed as such.
    """
    failed = failed or {}
    lines = [f"| system | peer | {metric} ratio vs peer (median, min-max) | target | met? | "
             "peak RSS MB system / peer | RSS <= peer? |", "|---" * 7 + "|"]
    for name, peer, target in pairs:
        both = [r for r in rounds if name in r and peer in r]
        if not both:
            why = f"peer failed: {failed[peer][:80]}" if peer in failed else "peer not run"
            lines.append(f"| {name} | {peer} | n/a ({why}) | {target or '-'} | - | - | - |")
            continue
        ratios = [r[name][metric] / r[peer][metric] for r in both]
        med = statistics.median(ratios)
        rss_s = statistics.median(r[name]["peak_rss_mb"] for r in both)
        rss_p = statistics.median(r[peer]["peak_rss_mb"] for r in both)
        met = "-" if target is None else ("met" if med >= target else "missed")
        lines.append(f"| {name} | {peer} | {med:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                     f"{'-' if target is None else f'>= {target:.2f}'} | {met} | {rss_s:,.0f} / {rss_p:,.0f} | "
                     f"{'yes' if rss_s <= rss_p else 'no'} |")
    return "\n".join(lines)


def round_ratios(rounds: Sequence[Dict[str, Dict[str, float]]], baseline: str, metric: str = "tokens_per_s"
                 ) -> Dict[str, List[float]]:
    """{system: [its metric / the baseline's, one per round in which both ran]}."""
    systems = list(dict.fromkeys(k for r in rounds for k in r))
    return {s: [r[s][metric] / r[baseline][metric] for r in rounds if s in r and baseline in r] for s in systems}


def write_plot(path: str, ratios: Dict[str, List[float]], *, title: str, baseline: str,
               targets: Dict[str, float] = None) -> None:
    """The ``--plot PATH`` option of the benchmarks: a bar chart of the ratios (lightning_scale.plot.plot_ratios)."""
    from lightning_scale.plot import plot_ratios

    try:
        drawn = plot_ratios(ratios, path, title=title, baseline=baseline, targets=targets)
    except ImportError as err:
        print(f"--plot: {err.name or err} is not installed (pip install matplotlib); no figure written")
        return
    print(f"\nwrote {path}: " + ", ".join(f"{k} {v[0]:.2f}" for k, v in drawn.items()))
