"""Check a :class:`~lightning_scale.pipeline.schedule.Schedule` and simulate it.

Three checks, each raising :class:`ScheduleError` with the offending action:

1. ordering on each rank: every (stage, micro-batch) runs one forward and then one backward (``B``,
   or ``I`` then ``W``; none at all in a forward-only schedule for evaluation); data is received
   before it is used and sent after it is produced;
2. matching: between two ranks, the sends of one kind are received in the same order (the runtime
   relies on in-order delivery, so a mismatch would silently swap tensors);
3. deadlock freedom: a discrete-event simulation where sends never block and a receive waits for
   its send; if no rank can move before all are done, the blocked actions are reported.

The simulation also yields the makespan with per-action costs, hence the bubble (idle fraction)
and per-rank idle time, and the peak number of live activations per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Set, Tuple

from lightning_scale.pipeline.schedule import (
    B, COMPUTE, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule, ScheduleError,
)

# Relative costs of one action on one (virtual) stage: a full backward costs two forwards.
DEFAULT_COSTS: Dict[str, float] = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}


@dataclass(frozen=True)
class ScheduleStats:
    makespan: float
    busy: Tuple[float, ...]  # per rank: time spent computing
    idle: Tuple[float, ...]  # per rank: makespan - busy (the bubble, in forward-time units)
    peak_live: Tuple[int, ...]  # per rank: most micro-batch activations held at once

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: (p-1)/(m+p-1) for GPipe/1F1B with uniform costs."""
        return sum(self.idle) / (len(self.idle) * self.makespan) if self.makespan else 0.0


def validate_schedule(schedule: Schedule, costs: Optional[Mapping[object, float]] = None,
                      latency: float = 0.0) -> ScheduleStats:
    """Raise ScheduleError if ``schedule`` is invalid; return its simulated statistics.

    ``costs`` maps an action kind (``"F"``, ``"B"``, ``"I"``, ``"W"``) to its cost on every stage,
    ``(kind, stage)`` to its cost on one stage (e.g. measured per-stage times, so the simulated
    bubble includes stage imbalance), and/or ``(kind, stage, microbatch)`` to the cost of one action
    (each action's measured time in one step, so the simulation also sees that step's jitter); the
    most specific entry wins, missing entries fall back to :data:`DEFAULT_COSTS`.
    """
    if len(schedule.actions) != schedule.num_ranks:
        raise ScheduleError(f"schedule {schedule.name!r} lists {len(schedule.actions)} ranks, expected "
                            f"{schedule.num_ranks}")
    cost: dict[object, float] = dict(DEFAULT_COSTS)
    cost.update(costs or {})
    peaks = tuple(_check_rank(schedule, r) for r in range(schedule.num_ranks))
    _check_complete(schedule)
    _check_matching(schedule)
    makespan, busy = simulate(schedule, cost, latency)
    idle = tuple(makespan - b for b in busy)
    return ScheduleStats(makespan=makespan, busy=tuple(busy), idle=idle, peak_live=peaks)


def _check_rank(sch: Schedule, r: int) -> int:
    """Ordering rules on rank r; returns its peak live activations."""
    p, S = sch.num_ranks, sch.num_stages
    mine = set(sch.rank_stages(r))
    done: Dict[str, Set[Tuple[int, int]]] = {k: set() for k in (F, B, I, W, RECV_F, RECV_B, SEND_F, SEND_B)}
    live = peak = 0
    split = sch.splits_backward
    for a in sch.actions[r]:
        key = (a.stage, a.microbatch)
        if a.stage not in mine or not 0 <= a.microbatch < sch.num_microbatches:
            raise ScheduleError(f"rank {r}: {a} names a stage or micro-batch this rank does not own")
        if key in done[a.kind]:
            raise ScheduleError(f"rank {r}: {a} appears twice")
        s = a.stage
        local_prev = s > 0 and (s - 1) % p == r
        local_next = s < S - 1 and (s + 1) % p == r
        if a.kind == F:
            if s > 0 and not local_prev and key not in done[RECV_F]:
                raise ScheduleError(f"rank {r}: {a} runs before its input is received")
            if local_prev and (s - 1, a.microbatch) not in done[F]:
                raise ScheduleError(f"rank {r}: {a} runs before the forward of stage {s - 1}")
            live += 1
        elif a.kind in (B, I):
            if key not in done[F]:
                raise ScheduleError(f"rank {r}: {a} runs before the forward of the same micro-batch")
            if key in done[B] or key in done[I]:
                raise ScheduleError(f"rank {r}: {a} is a second backward of the same micro-batch")
            if s < S - 1 and not local_next and key not in done[RECV_B]:
                raise ScheduleError(f"rank {r}: {a} runs before its output gradient is received")
            if local_next and (s + 1, a.microbatch) not in done[B] | done[I]:
                raise ScheduleError(f"rank {r}: {a} runs before the backward of stage {s + 1}")
            if a.kind == B:
                live -= 1
        elif a.kind == W:
            if key not in done[I]:
                raise ScheduleError(f"rank {r}: {a} runs before the input-gradient pass I of the same micro-batch")
            live -= 1
        elif a.kind in (SEND_F, RECV_F, SEND_B, RECV_B):
            _check_comm_action(sch, r, a, done)
        else:
            raise ScheduleError(f"rank {r}: unknown action kind {a.kind!r}")
        if a.kind == B and split:
            raise ScheduleError(f"rank {r}: {a} mixes a full backward into a split (I/W) schedule")
        done[a.kind].add(key)
        peak = max(peak, live)
    return peak


def _check_comm_action(sch: Schedule, r: int, a: Action, done: Dict[str, Set[Tuple[int, int]]]) -> None:
    p, S, s, key = sch.num_ranks, sch.num_stages, a.stage, (a.stage, a.microbatch)
    if a.kind == SEND_F:
        ok = s < S - 1 and a.peer == (s + 1) % p != r and key in done[F]
        why = "follow the forward it sends, to the rank of the next stage"
    elif a.kind == RECV_F:
        ok = s > 0 and a.peer == (s - 1) % p != r
        why = "come from the rank of the previous stage"
    elif a.kind == SEND_B:
        ok = s > 0 and a.peer == (s - 1) % p != r and (key in done[B] or key in done[I])
        why = "follow the backward it sends, to the rank of the previous stage"
    else:
        ok = s < S - 1 and a.peer == (s + 1) % p != r
        why = "come from the rank of the next stage"
    if not ok:
        raise ScheduleError(f"rank {r}: {a} is misplaced; it must {why}")


def _check_complete(sch: Schedule) -> None:
    split = sch.splits_backward
    forward_only = not any(a.kind in (B, I, W) for acts in sch.actions for a in acts)
    need = (F,) if forward_only else (F, I, W) if split else (F, B)
    have: Dict[str, Set[Tuple[int, int]]] = {k: set() for k in need}
    for acts in sch.actions:
        for a in acts:
            if a.kind in have:
                have[a.kind].add((a.stage, a.microbatch))
    for s in range(sch.num_stages):
        for i in range(sch.num_microbatches):
            for kind in need:
                if (s, i) not in have[kind]:
                    raise ScheduleError(f"schedule {sch.name!r} never runs {Action(kind, s, i)} "
                                        f"(on rank {sch.stage_rank(s)})")


def _check_matching(sch: Schedule) -> None:
    """Per (sender, receiver) pair, sends and receives list the same messages in the same order, activations and
    gradients together: NCCL matches point-to-point messages by order alone (no tags), and the runtime posts them in
    list order on one group per direction (lightning_scale.comm.p2p)."""
    sends: Dict[Tuple[int, int], List[Tuple[str, int, int]]] = {}
    recvs: Dict[Tuple[int, int], List[Tuple[str, int, int]]] = {}
    for r, acts in enumerate(sch.actions):
        for a in acts:
            # A message is named by (kind, sending stage, micro-batch).
            if a.kind == SEND_F:
                sends.setdefault((r, a.peer), []).append(("act", a.stage, a.microbatch))
            elif a.kind == SEND_B:
                sends.setdefault((r, a.peer), []).append(("grad", a.stage, a.microbatch))
            elif a.kind == RECV_F:
                recvs.setdefault((a.peer, r), []).append(("act", a.stage - 1, a.microbatch))
            elif a.kind == RECV_B:
                recvs.setdefault((a.peer, r), []).append(("grad", a.stage + 1, a.microbatch))
    for chan in sorted(set(sends) | set(recvs)):
        src, dst = chan
        out, inc = sends.get(chan, []), recvs.get(chan, [])
        for k in range(max(len(out), len(inc))):
            sent = out[k] if k < len(out) else None
            got = inc[k] if k < len(inc) else None
            if sent != got:
                raise ScheduleError(
                    f"rank {src} -> rank {dst}: message {k} is sent as (kind, stage, microbatch)={sent} but received "
                    f"as {got}; sends and receives between two ranks must match one to one, in order, activations "
                    "and gradients together (NCCL matches them by order alone)"
                )


def simulate(sch: Schedule, cost: Mapping[object, float], latency: float = 0.0) -> Tuple[float, List[float]]:
    """Run every rank's list with blocking receives and non-blocking sends; return (makespan, busy).

    ``cost[(kind, stage, microbatch)]``, when present, overrides ``cost[(kind, stage)]``, which overrides
    ``cost[kind]``.
    """
    p = sch.num_ranks
    ptr, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    posted: Dict[Tuple[str, int, int], float] = {}  # (kind, sending stage, mb) -> time the send was posted
    progress = True
    while progress:
        progress = False
        for r in range(p):
            acts = sch.actions[r]
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if a.kind in COMPUTE:
                    c = cost.get((a.kind, a.stage, a.microbatch))
                    if c is None:
                        c = cost.get((a.kind, a.stage), cost[a.kind])
                    clock[r] += c
                    busy[r] += c
                elif a.kind in (SEND_F, SEND_B):
                    posted[(a.kind, a.stage, a.microbatch)] = clock[r]
                else:
                    if a.kind == RECV_F:
                        key = (SEND_F, a.stage - 1, a.microbatch)
                    else:
                        key = (SEND_B, a.stage + 1, a.microbatch)
                    if key not in posted:
                        break  # blocked: the peer has not sent it yet
                    clock[r] = max(clock[r], posted[key] + latency)
                ptr[r] += 1
                progress = True
    stuck = [f"rank {r} waits in {sch.actions[r][ptr[r]]}" for r in range(p) if ptr[r] < len(sch.actions[r])]
    if stuck:
        raise ScheduleError(f"schedule {sch.name!r} deadlocks: " + "; ".join(stuck))
    return max(clock), busy
