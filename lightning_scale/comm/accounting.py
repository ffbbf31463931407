"""Byte accounting: every collective records the bytes it moves per rank.

The figures follow the bandwidth-optimal (ring) algorithms that NCCL and gloo use, so a test or a
benchmark can compare the measured volume with the ZeRO / Megatron formulas:

==================  =========================================  (n = payload bytes, N = group size)
all_reduce          2 * (N - 1) / N * n      (n = buffer size)
reduce_scatter      (N - 1) / N * n          (n = full input size)
all_gather          (N - 1) / N * n          (n = full output size)
all_to_all          (N - 1) / N * n          (n = buffer size)
broadcast           (N - 1) / N * n          (pipelined ring; n = buffer size)
send / recv         n
==================  =========================================

Counting is opt-in: ``with CommCounter() as c: ...`` collects what the collectives in this process
record while it is active (counters nest). Nothing is recorded when no counter is active.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict, List

_local = threading.local()


def _active() -> List["CommCounter"]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def algorithmic_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` over a group of ``group_size`` ranks (see module doc)."""
    n = group_size
    if n <= 1 and op not in ("send", "recv"):
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op in ("reduce_scatter", "all_gather", "all_to_all", "broadcast"):
        return (n - 1) / n * nbytes
    if op in ("send", "recv"):
        return float(nbytes)
    raise ValueError(f"unknown collective {op!r}")


def record(op: str, nbytes: int, group_size: int, tag: str = "") -> None:
    stack = _active()
    if not stack:
        return
    moved = algorithmic_bytes(op, nbytes, group_size)
    for counter in stack:
        counter._add(op, moved, tag)


class CommCounter:
    """Collects bytes moved per rank, by collective and by tag, while active."""

    def __init__(self) -> None:
        self.by_op: Dict[str, float] = defaultdict(float)
        self.by_tag: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)

    def _add(self, op: str, moved: float, tag: str) -> None:
        self.by_op[op] += moved
        self.calls[op] += 1
        if tag:
            self.by_tag[tag] += moved

    @property
    def total(self) -> float:
        return float(sum(self.by_op.values()))

    def reset(self) -> None:
        self.by_op.clear()
        self.by_tag.clear()
        self.calls.clear()

    def __enter__(self) -> "CommCounter":
        _active().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active().remove(self)

    def __repr__(self) -> str:
        ops = ", ".join(f"{k}={v:.0f}B/{self.calls[k]}" for k, v in sorted(self.by_op.items()))
        return f"CommCounter(total={self.total:.0f}B, {ops})"
