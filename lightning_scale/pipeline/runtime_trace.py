"""An off-by-default trace of what one pipeline rank did in its last step, and what it shows.

``PipelineRuntime(trace=True)`` (or ``LIGHTNING_SCALE_PIPELINE_TRACE=1`` in the environment) fills
``runtime.last_trace`` with one :class:`TraceEvent` per thing the rank did while running the schedule:

==============  ==========================================================================
``F B I W``     compute of (stage, micro-batch): autograd only, the wait for its data excluded
``recv_post``   an ``irecv`` posted (early, by prefetch, or at its ``RECV_*`` action)
``recv_wait``   the wait for that receive's data (``t_end - t_start`` = time blocked on the peer)
``send_post``   an ``isend`` posted
``send_done``   the first moment the rank saw the send complete (polled before each compute,
                so an upper bound on the completion time; absent if first seen at its wait)
``send_wait``   the wait call on the send (at the end of the step; right after the post when
                ``blocking=True``)
==============  ==========================================================================

Times are ``time.perf_counter()`` seconds: on one host that is the system monotonic clock, so
events of different ranks compare. Off, the runtime records nothing (one ``is None`` check per
action). The helpers below read traces; the test and ``bench/pipeline.py`` use them.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

COMPUTE = ("F", "B", "I", "W")
ENV = "LIGHTNING_SCALE_PIPELINE_TRACE"


class TraceEvent(NamedTuple):
    action: str  # F, B, I, W, recv_post, recv_wait, send_post, send_done, send_wait
    stage: int
    microbatch: int
    kind: str  # "act" / "grad" for transfers, "" for compute
    t_start: float
    t_end: float


def trace_from_env(trace: Optional[bool]) -> bool:
    """The ``trace=`` argument, or when it is None the environment switch."""
    if trace is not None:
        return bool(trace)
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


class Tracer:
    """Collects the events of one step; ``pending`` are sends not yet seen complete."""

    def __init__(self) -> None:
        self.events: List[TraceEvent] = []
        self.pending: List[Tuple[object, int, int, str]] = []  # (handle, stage, microbatch, kind)

    def add(self, action: str, stage: int, microbatch: int, kind: str, t_start: float, t_end: Optional[float] = None):
        self.events.append(TraceEvent(action, stage, microbatch, kind, t_start, t_start if t_end is None else t_end))

    def sent(self, handle, stage: int, microbatch: int, kind: str, t0: float) -> None:
        self.add("send_post", stage, microbatch, kind, t0, time.perf_counter())
        self.pending.append((handle, stage, microbatch, kind))

    def poll_sends(self) -> None:
        """Record ``send_done`` for every pending send that has completed by now."""
        if not self.pending:
            return
        now, still = time.perf_counter(), []
        for item in self.pending:
            if item[0].is_completed():
                self.add("send_done", item[1], item[2], item[3], now)
            else:
                still.append(item)
        self.pending = still

    def wait_sends(self) -> None:
        """Wait every send this step posted, one by one, each wait recorded."""
        self.poll_sends()
        for handle, stage, microbatch, kind in self.pending:
            t0 = time.perf_counter()
            handle.wait()
            self.add("send_wait", stage, microbatch, kind, t0, time.perf_counter())
        self.pending = []


def sends_waited_before_next_compute(events: Sequence[TraceEvent]) -> List[Tuple[TraceEvent, TraceEvent]]:
    """The (send_wait, next compute) pairs of one rank where a send's wait began before the compute that
    follows the send's post started: i.e. the rank's next compute waited on its own send. Empty when no
    send ever delays compute (the asynchronous path)."""
    computes = sorted((e for e in events if e.action in COMPUTE), key=lambda e: e.t_start)
    waits = {(e.stage, e.microbatch, e.kind): e for e in events if e.action == "send_wait"}
    bad = []
    for post in (e for e in events if e.action == "send_post"):
        nxt = next((c for c in computes if c.t_start >= post.t_end), None)
        wait = waits.get((post.stage, post.microbatch, post.kind))
        if nxt is not None and wait is not None and wait.t_start < nxt.t_start:
            bad.append((wait, nxt))
    return bad


def measured_bubble(traces: Sequence[Sequence[TraceEvent]]) -> float:
    """1 - compute / (ranks x makespan) for one step, from every pipeline rank's trace of it. The makespan
    runs from the first event of any rank to the last (transfers included, the end-of-step send waits too)."""
    start = min(e.t_start for tr in traces for e in tr)
    end = max(e.t_end for tr in traces for e in tr)
    busy = sum(e.t_end - e.t_start for tr in traces for e in tr if e.action in COMPUTE)
    return 1.0 - busy / (len(traces) * (end - start))


def compute_costs(traces: Sequence[Sequence[TraceEvent]]) -> Dict[Tuple[str, int], List[float]]:
    """{(action, stage): [seconds of each compute]}, over the given traces."""
    out: Dict[Tuple[str, int], List[float]] = {}
    for tr in traces:
        for e in tr:
            if e.action in COMPUTE:
                out.setdefault((e.action, e.stage), []).append(e.t_end - e.t_start)
    return out


def blocked_s(events: Sequence[TraceEvent]) -> Dict[str, float]:
    """Seconds one rank spent in each kind of wait / post: {"recv_wait": s, "send_wait": s, ...}."""
    out: Dict[str, float] = {}
    for e in events:
        if e.action not in COMPUTE and e.action != "send_done":
            out[e.action] = out.get(e.action, 0.0) + e.t_end - e.t_start
    return out


def handoff_latencies(traces: Sequence[Sequence[TraceEvent]]) -> List[float]:
    """Seconds from a send's post to the end of the receiver's wait for it, for every transfer the receiver was
    already waiting for when it was posted (so the figure is transfer + wake-up latency, not waiting for compute).
    ``traces``: every pipeline rank's trace of one step; stage ids are global, so sender and receiver match by
    (kind, sending stage, micro-batch)."""
    posts = {(e.kind, e.stage, e.microbatch): e for tr in traces for e in tr if e.action == "send_post"}
    out = []
    for tr in traces:
        for e in tr:
            if e.action != "recv_wait":
                continue
            sender = e.stage - 1 if e.kind == "act" else e.stage + 1
            post = posts.get((e.kind, sender, e.microbatch))
            if post is not None and e.t_start <= post.t_start:
                out.append(e.t_end - post.t_start)
    return out
