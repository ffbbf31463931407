"""Debug mode: every collective's (op, bytes, tag) compared across its group, call by call, through the store.

Each rank writes ``fp/<group ranks>/<n>/<rank>`` for the n-th collective it enters on a group; every member
but the group's first waits for the first member's entry n and compares. A rank that skipped or added a
collective is reported with both ranks' sequence numbers, as :class:`CollectiveMismatchError`, before the
mismatched collective can hang. One store round trip per collective: a debugging tool, not for speed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict

from lightning_scale.diagnostics import trace
from lightning_scale.diagnostics.trace import CollectiveMismatchError


class Fingerprinter:
    def __init__(self, store: Any, rank: int, timeout: float) -> None:
        self.store, self.rank, self.timeout = store, rank, float(timeout)
        self.calls: Dict[str, int] = {}  # group key -> collectives entered on that group

    def check(self, op: str, nbytes: int, group: Any, tag: str, seq: int) -> None:
        if op.startswith(("send", "recv")):  # point-to-point: the two sides differ by design
            return
        ranks = trace.group_ranks(group)
        key = ",".join(map(str, ranks))
        n = self.calls.get(key, 0) + 1
        self.calls[key] = n
        mine = f"{op}|{nbytes}|{tag}|{seq}"
        self.store.set(f"fp/{key}/{n}/{self.rank}", mine)
        root = ranks[0]
        if root == self.rank:
            return
        theirs_key = f"fp/{key}/{n}/{root}"
        label = trace.group_label(group)
        try:
            self.store.wait([theirs_key], timedelta(seconds=self.timeout))
        except Exception as err:  # noqa: BLE001 - a store timeout: the first member never got there
            raise CollectiveMismatchError(
                f"collective mismatch on {label}: rank {self.rank} entered call {n} of the group, {op} ({nbytes} B, "
                f"tag {tag or '-'}; its collective #{seq}), but rank {root} did not enter a call {n} within "
                f"{self.timeout:.0f} s ({type(err).__name__})") from None
        theirs = self.store.get(theirs_key).decode()
        if theirs.rsplit("|", 1)[0] != mine.rsplit("|", 1)[0]:
            op0, bytes0, tag0, seq0 = theirs.split("|")
            raise CollectiveMismatchError(
                f"collective mismatch on {label} at call {n} of the group: rank {self.rank} entered {op} "
                f"({nbytes} B, tag {tag or '-'}) as its collective #{seq}, rank {root} entered {op0} ({bytes0} B, "
                f"tag {tag0 or '-'}) as its collective #{seq0}")
