"""What this process's collectives are doing: the last one entered and the one the main thread waits in.

Every collective of ``lightning_scale.comm`` calls :func:`enter` when it is posted and :func:`wait_begin` /
:func:`wait_end` around its wait. The record is a handful of attribute writes (no lock, no allocation), so
it is always on; the watchdog's monitor thread reads it (a torn read only costs one heartbeat's accuracy).

The debug fingerprint mode (``LIGHTNING_SCALE_DEBUG_COLLECTIVES=1`` or :func:`set_fingerprinter`) also
compares each collective's (op, bytes, tag) with the group's first member through the c10d store, per
group and per sequence number, and raises :class:`CollectiveMismatchError` naming both ranks' numbers.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

DEBUG_ENV = "LIGHTNING_SCALE_DEBUG_COLLECTIVES"


class CollectiveMismatchError(RuntimeError):
    """Two ranks of one group entered different collectives at the same sequence number."""


class _Record:
    __slots__ = ("seq", "op", "tag", "nbytes", "group", "entered_at", "done", "wait_seq", "wait_op", "wait_tag",
                 "wait_nbytes", "wait_group", "wait_since", "step")

    def __init__(self) -> None:
        self.seq = 0  # collectives entered by this process (all groups)
        self.op, self.tag, self.nbytes, self.group, self.entered_at = "", "", 0, None, 0.0
        self.done = 0  # highest sequence number whose wait returned
        self.wait_seq = 0  # != 0 while the calling thread is blocked in that collective's wait
        self.wait_op, self.wait_tag, self.wait_nbytes, self.wait_group, self.wait_since = "", "", 0, None, 0.0
        self.step = 0  # optimizer steps completed (set by the training loop glue)


RECORD = _Record()
_fingerprinter: Optional[Any] = None
_pending: Dict[int, tuple] = {}  # seq -> (op, tag, nbytes, group) of posted, not yet waited collectives


def enter(op: str, nbytes: int, group: Any, tag: str, blocking: bool = False) -> int:
    """A collective is posted; returns its sequence number (give it to wait_begin / wait_end).

    ``blocking``: the caller blocks inside the call itself (``async_op=False``), so the wait starts now; the
    caller ends it with :func:`wait_end`."""
    r = RECORD
    r.seq += 1
    now = time.monotonic()
    r.op, r.tag, r.nbytes, r.group, r.entered_at = op, tag, nbytes, group, now
    if _fingerprinter is not None:
        _fingerprinter.check(op, nbytes, group, tag, r.seq)
    if blocking:
        r.wait_op, r.wait_tag, r.wait_nbytes, r.wait_group, r.wait_since = op, tag, nbytes, group, now
        r.wait_seq = r.seq
    elif len(_pending) < 64:  # async handles are normally waited soon; the cap keeps a leak harmless
        _pending[r.seq] = (op, tag, nbytes, group)
    return r.seq


def wait_begin(seq: int) -> None:
    r = RECORD
    info = _pending.get(seq)
    if info is None:
        info = (r.op, r.tag, r.nbytes, r.group)
    r.wait_op, r.wait_tag, r.wait_nbytes, r.wait_group = info
    r.wait_since = time.monotonic()
    r.wait_seq = seq


def wait_end(seq: int) -> None:
    r = RECORD
    r.wait_seq = 0
    _pending.pop(seq, None)
    if seq > r.done:
        r.done = seq


def step_done(step: int) -> None:
    RECORD.step = step


def set_fingerprinter(fp: Optional[Any]) -> None:
    """Install (or remove with None) an object whose ``check(op, nbytes, group, tag, seq)`` sees every collective."""
    global _fingerprinter
    _fingerprinter = fp


def debug_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def reset() -> None:
    """Forget everything (tests; a new process group)."""
    global RECORD
    fresh = _Record()
    for name in _Record.__slots__:
        setattr(RECORD, name, getattr(fresh, name))
    _pending.clear()


# ------------------------------------------------------------------------------------------ group names
_group_names: Dict[int, str] = {}


def name_group(group: Any, axis: str) -> None:
    """Label a process group with its parallelism axis ("dp", "tp", "pp") for the diagnosis."""
    _group_names[id(group)] = axis


def group_label(group: Any) -> str:
    """'dp [0, 1]' / 'world [0, 1]': the axis (when labelled) and the global ranks of ``group``."""
    import torch.distributed as dist

    name = _group_names.get(id(group))
    try:
        if group is None or group is dist.group.WORLD:
            name = name or "world"
            ranks = list(range(dist.get_world_size()))
        else:
            ranks = dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - a destroyed group: the label is best effort
        ranks = []
    return f"{name or 'group'} {ranks}"


def group_ranks(group: Any):
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def describe(op: str, tag: str, nbytes: int, group: Any, seq: int) -> str:
    return f"{op} #{seq} (axis {group_label(group)}, tag {tag or '-'}, {nbytes} B)"
