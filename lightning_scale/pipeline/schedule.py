"""Pipeline schedules as data, and a validator that simulates them.

A schedule is, for every pipeline rank, the ordered list of :class:`Action` it performs in one
training step: compute (``F`` forward, ``B`` full backward, or ``I`` input-grad + ``W`` weight-grad
for zero-bubble schedules) of micro-batch ``m`` on (virtual) stage ``s``, and the sends/receives
those imply. Keeping schedules as plain data means every property that matters (each forward
before its backward, each send matched by a receive in the same order, no deadlock, peak live
activations, bubble) is checked by a pure test without processes; the runtime only lowers the
list to point-to-point calls and autograd.

Stages: with ``p`` ranks and ``v`` virtual stages per rank there are ``S = p * v`` stages; stage
``s`` lives on rank ``s % p`` as that rank's chunk ``s // p`` (Megatron's interleaved layout), so
consecutive stages are always on neighbouring ranks.

Communication model (what the runtime does and the simulator assumes): a send never blocks (it
is posted asynchronously and waited at the end of the step); a receive blocks until the matching
send has been posted. Between two ranks, messages are matched in order (per kind on gloo, whose tags
keep activations and gradients apart; all together on NCCL, which has no tags), so the validator checks
that both sides list them in the same order, kinds together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from lightning_scale.config import ConfigError
from lightning_scale.pipeline.zero_bubble import zero_bubble_orders

F, B, I, W = "F", "B", "I", "W"  # forward, full backward, input-grad, weight-grad
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, I, W)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)


class ScheduleError(ValueError):
    """A schedule breaks a rule (ordering, matching, deadlock); the message names the action."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank.

    Compute actions name the stage that runs. ``SEND_F`` / ``SEND_B`` name the stage whose output
    (activation) / input-gradient is sent; ``RECV_F`` / ``RECV_B`` name the stage that receives
    its input / its output-gradient. ``peer`` is the other pipeline rank of a send or receive.
    """

    kind: str
    stage: int
    microbatch: int
    peer: int = -1

    def __str__(self) -> str:
        arrow = {SEND_F: "->", SEND_B: "->", RECV_F: "<-", RECV_B: "<-"}.get(self.kind)
        tail = f"{arrow}r{self.peer}" if arrow else ""
        return f"{self.kind}(s{self.stage},m{self.microbatch}){tail}"


@dataclass(frozen=True)
class Schedule:
    name: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    actions: Tuple[Tuple[Action, ...], ...]  # actions[rank] in execution order

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    def stage_rank(self, stage: int) -> int:
        return stage % self.num_ranks

    def rank_stages(self, rank: int) -> List[int]:
        return [rank + c * self.num_ranks for c in range(self.virtual_stages)]

    @property
    def splits_backward(self) -> bool:
        return any(a.kind == I for acts in self.actions for a in acts)

    def forward_only(self) -> "Schedule":
        """The forward actions (and activation transfers) of this schedule, for evaluation."""
        keep = (F, SEND_F, RECV_F)
        acts = tuple(tuple(a for a in rank_acts if a.kind in keep) for rank_acts in self.actions)
        return Schedule(f"{self.name}/forward", self.num_ranks, self.num_microbatches, self.virtual_stages, acts)

    def describe(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions))


# --------------------------------------------------------------------------- compute orders
Order = List[Tuple[str, int, int]]  # (kind, stage, microbatch) compute actions of one rank


def gpipe_orders(p: int, m: int, v: int = 1) -> List[Order]:
    """All forwards, then all backwards: peak live activations = m per stage."""
    return [[(F, r, i) for i in range(m)] + [(B, r, i) for i in range(m)] for r in range(p)]


def one_f_one_b_orders(p: int, m: int, v: int = 1) -> List[Order]:
    """PipeDream-flush 1F1B: rank r runs p-1-r warm-up forwards, then alternates F and B."""
    orders = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        order: Order = [(F, r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [(F, r, warm + i), (B, r, i)]
        order += [(B, r, i) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def interleaved_orders(p: int, m: int, v: int) -> List[Order]:
    """Megatron's interleaved 1F1B: each rank owns v chunks; micro-batches advance in groups.

    Every rank walks the same forward sequence of (chunk, micro-batch): for each group of
    micro-batches, chunk 0 for the whole group, then chunk 1, ...; the backward sequence visits the
    chunks in reverse. A group must hold at least p micro-batches, or a rank would wait for its
    own next chunk's input: groups have p micro-batches, except the first, which also takes the
    remainder m mod p (Megatron requires m % p == 0; this keeps the ideal bubble
    (p-1)/(v m + p - 1) for every m >= p). Rank r runs ``2 (p - 1 - r) + (v - 1) g0`` warm-up
    forwards (g0 = first group size), then alternates one forward and one backward.
    """
    if v == 1:
        return one_f_one_b_orders(p, m)
    q, rem = divmod(m, p)
    sizes = [p + rem] + [p] * (q - 1) if q else [m]
    fwd: List[Tuple[int, int]] = []  # (chunk, microbatch)
    bwd: List[Tuple[int, int]] = []
    start = 0
    for size in sizes:
        group = range(start, start + size)
        start += size
        fwd += [(c, i) for c in range(v) for i in group]
        bwd += [(c, i) for c in reversed(range(v)) for i in group]
    total = m * v
    orders = []
    for r in range(p):
        warm = min(2 * (p - 1 - r) + (v - 1) * sizes[0], total)
        seq: List[Tuple[str, int, int]] = [(F, c, i) for c, i in fwd[:warm]]
        for k in range(total - warm):
            seq += [(F, *fwd[warm + k]), (B, *bwd[k])]
        seq += [(B, c, i) for c, i in bwd[total - warm:]]
        orders.append([(kind, r + c * p, i) for kind, c, i in seq])
    return orders


def _zero_bubble(p: int, m: int, v: int = 1) -> List[Order]:
    return zero_bubble_orders(p, m)


# name -> (compute-order builder, supports virtual stages > 1)
_BUILDERS: Dict[str, Tuple[Callable[[int, int, int], List[Order]], bool]] = {
    "gpipe": (gpipe_orders, False),
    "1f1b": (one_f_one_b_orders, False),
    "interleaved_1f1b": (interleaved_orders, True),
    "zero_bubble": (_zero_bubble, False),
}


def available_schedules() -> List[str]:
    return list(_BUILDERS)


def build_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The named schedule for ``num_ranks`` pipeline ranks and ``num_microbatches`` micro-batches."""
    key = name.lower().replace("-", "_")
    key = {"interleaved": "interleaved_1f1b", "zb": "zero_bubble", "zbh1": "zero_bubble"}.get(key, key)
    if key not in _BUILDERS:
        raise ConfigError(f"pipeline.schedule={name!r} is unknown; available: {', '.join(_BUILDERS)}")
    for label, value in (("pp", num_ranks), ("pipeline.microbatches", num_microbatches),
                         ("pipeline.virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{label}={value!r} must be a positive integer")
    builder, virtual = _BUILDERS[key]
    if virtual_stages > 1 and not virtual:
        raise ConfigError(
            f"pipeline.virtual_stages={virtual_stages} needs pipeline.schedule='interleaved_1f1b' (got {name!r})"
        )
    orders = builder(num_ranks, num_microbatches, virtual_stages)
    return lower(key, num_ranks, num_microbatches, virtual_stages, orders)


def lower(name: str, p: int, m: int, v: int, orders: Sequence[Order]) -> Schedule:
    """Insert the sends and receives each compute action implies (receive just before, send just after)."""
    num_stages = p * v
    out = []
    for r, order in enumerate(orders):
        acts: List[Action] = []
        for kind, s, i in order:
            prev_rank, next_rank = (s - 1) % p, (s + 1) % p
            has_prev = s > 0 and prev_rank != r
            has_next = s < num_stages - 1 and next_rank != r
            if kind == F:
                if has_prev:
                    acts.append(Action(RECV_F, s, i, prev_rank))
                acts.append(Action(F, s, i))
                if has_next:
                    acts.append(Action(SEND_F, s, i, next_rank))
            elif kind in (B, I):
                if has_next:
                    acts.append(Action(RECV_B, s, i, next_rank))
                acts.append(Action(kind, s, i))
                if has_prev:
                    acts.append(Action(SEND_B, s, i, prev_rank))
            elif kind == W:
                acts.append(Action(W, s, i))
            else:
                raise ScheduleError(f"unknown compute kind {kind!r} in schedule {name!r}")
        out.append(tuple(acts))
    return Schedule(name, p, m, v, tuple(out))


__all__ = [
    "Action", "Schedule", "ScheduleError", "available_schedules", "build_schedule", "gpipe_orders",
    "interleaved_orders", "lower", "one_f_one_b_orders", "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
]
