"""Schedules as data: every schedule validates, bubbles match theory, the validator catches mistakes."""

from __future__ import annotations

import pytest

from lightning_scale.config import ConfigError
from lightning_scale.pipeline.schedule import (
    B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, Schedule, ScheduleError, available_schedules,
    build_schedule, lower, one_f_one_b_orders,
)
from lightning_scale.pipeline.validate import validate_schedule

GRID = [(p, m) for p in (2, 3, 4) for m in sorted({p, 2 * p, 8})]


def _with_v(name):
    return (1, 2) if name == "interleaved_1f1b" else (1,)


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_every_schedule_validates_with_theoretical_bubble(name, p, m):
    for v in _with_v(name):
        sch = build_schedule(name, p, m, v)
        stats = validate_schedule(sch)
        if name == "zero_bubble":
            # ZB-H1 with F = I = W: each rank idles p - 1 units instead of 1F1B's 3 (p - 1).
            expected = (p - 1) / (3 * m + p - 1)
            one_f_one_b = validate_schedule(build_schedule("1f1b", p, m)).bubble_fraction
            assert stats.bubble_fraction < one_f_one_b
        elif name == "interleaved_1f1b":
            expected = (p - 1) / (v * m + p - 1)
        else:
            expected = (p - 1) / (m + p - 1)
        assert stats.bubble_fraction == pytest.approx(expected, abs=1e-12), (name, p, m, v)
        # every forward / backward of every stage and micro-batch runs exactly once (checked by the
        # validator); here: the compute count per rank is what the schedule promises
        per_rank = (3 if name == "zero_bubble" else 2) * m * v
        for acts in sch.actions:
            assert sum(a.kind in (F, B, "I", "W") for a in acts) == per_rank


@pytest.mark.parametrize("p,m", GRID)
def test_peak_live_activations(p, m):
    peaks = validate_schedule(build_schedule("1f1b", p, m)).peak_live
    assert all(peak <= p for peak in peaks)
    assert list(peaks) == [min(p - r, m) for r in range(p)]  # rank r holds p - r (1F1B's point)
    assert validate_schedule(build_schedule("gpipe", p, m)).peak_live == (m,) * p
    assert max(validate_schedule(build_schedule("zero_bubble", p, m)).peak_live) <= p


def test_interleaved_fewer_microbatches_than_ranks_is_still_valid():
    for p in (2, 3, 4):
        for m in range(1, p):
            validate_schedule(build_schedule("interleaved_1f1b", p, m, 2))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_forward_only_schedules_are_valid_for_evaluation(name):
    for p, m in GRID:
        for v in _with_v(name):
            fwd = build_schedule(name, p, m, v).forward_only()
            assert all(a.kind in (F, SEND_F, RECV_F) for acts in fwd.actions for a in acts)
            stats = validate_schedule(fwd)
            assert stats.peak_live == (m * v,) * p  # nothing is freed without backward


def test_single_rank_pipeline_has_no_communication():
    sch = build_schedule("interleaved_1f1b", 1, 4, 3)
    assert not any(a.kind in (SEND_F, RECV_F, SEND_B, RECV_B) for a in sch.actions[0])
    assert validate_schedule(sch).bubble_fraction == 0


def test_unknown_schedule_lists_available():
    with pytest.raises(ConfigError) as err:
        build_schedule("pipedream", 2, 4)
    for name in available_schedules():
        assert name in str(err.value)
    assert set(available_schedules()) == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}


def test_bad_sizes_and_virtual_stages_without_interleaving():
    with pytest.raises(ConfigError, match="pipeline.virtual_stages=2 needs"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ConfigError, match="pipeline.microbatches=0"):
        build_schedule("gpipe", 2, 0)


# ----------------------------------------------------------------------------- validator catches mistakes
def _replace(sch: Schedule, rank: int, acts) -> Schedule:
    rows = list(sch.actions)
    rows[rank] = tuple(acts)
    return Schedule(sch.name, sch.num_ranks, sch.num_microbatches, sch.virtual_stages, tuple(rows))


def test_validator_rejects_backward_before_forward():
    orders = one_f_one_b_orders(2, 2)
    orders[1] = [(B, 1, 0), (F, 1, 0), (F, 1, 1), (B, 1, 1)]
    with pytest.raises(ScheduleError, match="before the forward"):
        validate_schedule(lower("bad", 2, 2, 1, orders))


def test_validator_rejects_unmatched_send():
    sch = build_schedule("1f1b", 2, 2)
    acts = [a for a in sch.actions[0] if not (a.kind == SEND_F and a.microbatch == 1)]
    with pytest.raises(ScheduleError, match="sent as|never|received"):
        validate_schedule(_replace(sch, 0, acts))


def test_validator_rejects_out_of_order_receives():
    # rank 1 receives micro-batch 1 before 0 while rank 0 sends 0 first: tensors would be swapped.
    orders = one_f_one_b_orders(2, 2)
    orders[1] = [(F, 1, 1), (B, 1, 1), (F, 1, 0), (B, 1, 0)]
    with pytest.raises(ScheduleError, match="in order"):
        validate_schedule(lower("bad", 2, 2, 1, orders))


def test_validator_matches_activations_and_gradients_together():
    """NCCL has no tags: between two ranks the messages meet in posting order whatever their kind. Rank 0 of interleaved
    pp=2 receives from rank 1 both activations (stage 1 -> 2) and gradients (stage 3 -> 2); listing a gradient receive
    before an activation receive that rank 1 sends first keeps each kind in order, and is refused."""
    sch = build_schedule("interleaved_1f1b", 2, 2, 2)
    acts = list(sch.actions[0])
    grad = next(a for a in acts if a.kind == RECV_B and a.stage == 2 and a.microbatch == 0)
    act = next(a for a in acts if a.kind == RECV_F and a.stage == 2 and a.microbatch == 0)
    acts.remove(grad)
    acts.insert(acts.index(act), grad)
    for kind in (RECV_F, RECV_B):  # each kind's receives keep their order
        assert [a for a in acts if a.kind == kind] == [a for a in sch.actions[0] if a.kind == kind]
    with pytest.raises(ScheduleError, match=r"rank 1 -> rank 0: message 0 is sent as .*'act'.* but received as "
                                            r".*'grad'.*activations and gradients together"):
        validate_schedule(_replace(sch, 0, acts))


def test_validator_detects_deadlock():
    # rank 0 waits for the gradient of micro-batch 0 before sending the activation rank 1 needs.
    acts0 = (Action(F, 0, 0), Action(RECV_B, 0, 0, 1), Action(SEND_F, 0, 0, 1), Action(B, 0, 0))
    acts1 = (Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(B, 1, 0), Action(SEND_B, 1, 0, 0))
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate_schedule(Schedule("bad", 2, 1, 1, (acts0, acts1)))


def test_validator_rejects_missing_backward_and_duplicates():
    sch = build_schedule("gpipe", 2, 2)
    no_b = [a for a in sch.actions[0] if not (a.kind == B and a.microbatch == 1)]
    with pytest.raises(ScheduleError, match="never runs"):
        validate_schedule(_replace(sch, 0, no_b))
    dup = list(sch.actions[0]) + [Action(F, 0, 0)]
    with pytest.raises(ScheduleError, match="twice"):
        validate_schedule(_replace(sch, 0, dup))


def test_validator_rejects_wrong_peer_and_foreign_stage():
    sch = build_schedule("1f1b", 3, 3)
    wrong_peer = [Action(a.kind, a.stage, a.microbatch, 2) if a.kind == SEND_F else a for a in sch.actions[0]]
    with pytest.raises(ScheduleError, match="misplaced"):
        validate_schedule(_replace(sch, 0, wrong_peer))
    with pytest.raises(ScheduleError, match="does not own"):
        validate_schedule(_replace(sch, 0, list(sch.actions[0]) + [Action(F, 1, 0)]))


def test_describe_lists_every_rank():
    text = build_schedule("1f1b", 2, 2).describe()
    assert text.splitlines()[0].startswith("rank 0: F(s0,m0) SEND_F(s0,m0)->r1")
    assert len(text.splitlines()) == 2


def test_per_stage_costs_put_stage_imbalance_into_the_simulated_bubble():
    """costs[(kind, stage)] overrides costs[kind] on one stage: a last stage twice as slow idles the first."""
    sch = build_schedule("1f1b", 2, 8)
    even = validate_schedule(sch, {F: 1.0, B: 2.0})
    assert even.bubble_fraction == pytest.approx(1 / 9)  # (p - 1) / (m + p - 1)
    slow = validate_schedule(sch, {F: 1.0, B: 2.0, (F, 1): 2.0, (B, 1): 4.0})
    assert slow.bubble_fraction > even.bubble_fraction + 0.1
    assert slow.makespan > 2 * 8 * 3.0 - 1e-9  # the slow stage's own work bounds the step


def test_per_action_costs_override_per_stage_costs():
    """costs[(kind, stage, microbatch)] is one action's time (a step's measured jitter): stage 1's first
    forward 5 units late delays the whole 1F1B step by 5 (every later action depends on it)."""
    sch = build_schedule("1f1b", 2, 4)
    even = validate_schedule(sch, {F: 1.0, B: 2.0, (F, 1): 1.0})
    assert even.makespan == pytest.approx(5 * 3.0)  # (m + p - 1) (F + B)
    late = validate_schedule(sch, {F: 1.0, B: 2.0, (F, 1): 1.0, (F, 1, 0): 6.0})
    assert late.makespan == pytest.approx(even.makespan + 5.0)
    assert late.busy[1] == pytest.approx(even.busy[1] + 5.0) and late.busy[0] == pytest.approx(even.busy[0])
