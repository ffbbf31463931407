"""The memory plan at pp > 1 (lightning_scale/pipeline_plan.py): the walk of a pipeline rank's schedule.

Pure: the schedules of lightning_scale.pipeline.schedule, per-micro-batch bytes given by hand. The in-flight count
is 1F1B's min(pp - s, m) and GPipe's m without either being written into the walk; interleaved / zero-bubble agree
with the schedule validator's live count; the sent buffers stay until the step's end; receives are prefetched only
once their channel's shape is known (step 1 vs the steady state).
"""

from __future__ import annotations

import pytest

from lightning_scale.pipeline.schedule import build_schedule
from lightning_scale.pipeline.validate import validate_schedule
from lightning_scale.pipeline_plan import StageBytes, pipeline_activations, schedule_peak


def _peaks(name, p, m, v=1, **bytes_):
    sch = build_schedule(name, p, m, v)
    return [schedule_peak(sch, r, {s: StageBytes(**{"keep": 100.0, "backward": 10.0, **bytes_})
                                   for s in sch.rank_stages(r)}) for r in range(p)]


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 8)])
def test_1f1b_keeps_min_pp_minus_stage_micro_batches(p, m):
    for s, w in enumerate(_peaks("1f1b", p, m)):
        assert w.max_in_flight == min(p - s, m), (s, w)
        assert w.peak == 100.0 * min(p - s, m) + 10.0, (s, w)  # the live ones + one backward's working set
        assert w.at.startswith("B(")


@pytest.mark.parametrize("p,m", [(2, 4), (4, 3)])
def test_gpipe_keeps_every_micro_batch(p, m):
    assert [w.max_in_flight for w in _peaks("gpipe", p, m)] == [m] * p


@pytest.mark.parametrize("name,p,m,v", [("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2),
                                        ("zero_bubble", 2, 4, 1), ("zero_bubble", 4, 8, 1)])
def test_other_schedules_follow_their_action_lists(name, p, m, v):
    sch = build_schedule(name, p, m, v)
    stats = validate_schedule(sch)
    for r, w in enumerate(_peaks(name, p, m, v)):
        # the validator counts a micro-batch live from F to B / I; the walk keeps it to W (an upper bound)
        assert w.max_in_flight >= stats.peak_live[r], (r, w, stats.peak_live)
        if name != "zero_bubble":
            assert w.max_in_flight == stats.peak_live[r], (r, w, stats.peak_live)


def test_sent_buffers_stay_until_the_end_of_the_step():
    # nothing kept: only the sends. Stage 0 of 1F1B (pp=2, m=4) sends an activation per forward and holds them
    # all at its last backward; stage 1 sends an input gradient per backward
    sch = build_schedule("1f1b", 2, 4)
    w0 = schedule_peak(sch, 0, {0: StageBytes(keep=0.0, backward=0.0, out=1.0)})
    w1 = schedule_peak(sch, 1, {1: StageBytes(keep=0.0, backward=0.0, grad=1.0)})
    assert (w0.peak, w0.p2p) == (4.0, 4.0) and w0.at == "F(s0,m3)", w0  # from its last forward on
    assert w1.peak == 4.0 and w1.at == "B(s1,m3)", w1  # the last stage sends no activation, 4 gradients


def test_receives_prefetch_once_the_shape_is_known():
    sch = build_schedule("gpipe", 2, 4)
    stages = {1: StageBytes(keep=0.0, backward=0.0, recv_f=1.0)}
    w = schedule_peak(sch, 1, stages, prefetch=2)
    # step 1: the first receive learns the header, so at most the next 2 are posted ahead of the schedule
    assert w.peak == 2.0 and w.steady == 2.0, w
    assert schedule_peak(sch, 1, stages, prefetch=0).peak == 0.0


def test_tied_exchange_counts_after_the_schedule():
    sch = build_schedule("1f1b", 2, 2)
    w = schedule_peak(sch, 0, {0: StageBytes(keep=1.0, backward=0.0)}, tied_bytes=50.0)
    assert w.peak == 50.0 and w.at == "tied gradient exchange", w


def test_stage_activations_from_one_unit_profile():
    sch = build_schedule("1f1b", 2, 4)
    prof = {"saved": 1000.0, "input": 100.0, "selective": 300.0, "backward": 200.0}
    common = dict(schedule=sch, seq_len=64, micro_batch=1, per_token=prof, hidden=32, vocab=128,
                  precision="32-true")
    a0 = pipeline_activations(pp_rank=0, units={0: 2}, **common)
    a1 = pipeline_activations(pp_rank=1, units={1: 2}, **common)
    T, sent = 64, 64 * 32 * 4
    # stage 0: 2 micro-batches of 2 units + one unit's backward + the p2p buffers then: at B(s0,m1) the 3
    # activations sent so far and 2 output gradients received ahead of the schedule
    assert a0.peak == 2 * 2 * 1000 * T + 200 * T + 5 * sent and a0.pipeline.at == "B(s0,m1)", a0
    assert a0.pipeline.in_flight == 2 and a0.head == 0 and a0.loss == 0
    # the last stage: 1 micro-batch + the head + the fp32 log-softmax it keeps, then the loss step
    lsm = T * 128 * 4
    head, loss = 2 * T * 32 * 4, T * 128 * 12
    assert a1.pipeline.in_flight == 1
    assert a1.peak >= 2 * 1000 * T + max(head + loss, 200 * T), a1
    full = pipeline_activations(pp_rank=0, units={0: 2}, activation_checkpointing="full", **common)
    assert full.peak < a0.peak and full.pipeline.in_flight == 2
    assert lsm > 0


def test_each_stage_takes_its_own_units_profile():
    """Units of several kinds (a hybrid's attention and Mamba layers): a stage's plan is its own units' bytes, not the
    model's mean (OLMo hybrid at pp=2 was 1.73x under), and a stage with no entry takes the model's profile."""
    from lightning_scale.activation_plan import UnitProfile, units_profile

    light = {"saved": 100.0, "input": 10.0, "selective": 30.0, "backward": 20.0}
    heavy = {"saved": 900.0, "input": 10.0, "selective": 300.0, "backward": 500.0}
    prof = UnitProfile(per_token={"saved": 500.0, "input": 10.0, "selective": 165.0, "backward": 500.0}, layers=4,
                       hidden=32, vocab=128, chunk=0, unit_type=object, source="profiled", notes=(),
                       per_unit=(light, heavy, light, None))
    assert units_profile(prof, [0, 2]) == {**light, "selective_saved": 30.0}  # (a counted unit: all it keeps)
    assert units_profile(prof, [0, 1]) == {"saved": 500.0, "input": 10.0, "selective": 165.0, "backward": 500.0,
                                           "selective_saved": 165.0}
    assert units_profile(prof, [3]) is prof.per_token  # no profile of its own (a unit without parameters)
    # the working sets in the order the units run: the heavy unit first, its backward runs after the light one freed
    # what it kept (not kept-all + the largest)
    assert units_profile(prof, [1, 0])["backward"] == 500.0 - 100.0
    # full checkpointing: the heavy unit's recompute (saved - input + backward) with the light unit's input still kept
    # before it, over the mean unit's (estimate_activations adds saved - input of the mean)
    full = units_profile(prof, [0, 1], "full")
    assert full["saved"] - full["input"] + full["backward"] == (900.0 - 10.0 + 500.0)
    assert units_profile(prof, [1, 0], "full")["backward"] == 900.0 - 10.0 + 500.0 - 10.0 - (500.0 - 10.0)
    sch = build_schedule("1f1b", 2, 1)
    common = dict(schedule=sch, seq_len=64, micro_batch=1, per_token=prof.per_token, hidden=32, vocab=128,
                  precision="32-true", pp_rank=0, units={0: 2})
    mean = pipeline_activations(**common)
    own = pipeline_activations(stage_per_token={0: units_profile(prof, [0, 2])}, **common)
    assert own.kept == 2 * 100 * 64 < mean.kept == 2 * 500 * 64
    assert pipeline_activations(stage_per_token={1: heavy}, **common).kept == mean.kept


def test_zero_bubble_holds_the_weight_work_until_w():
    # ZB-H1, pp=2, m=4: rank 0 runs each W right after its I; rank 1 defers one W, so at I(s1,m1) micro-batch 0
    # still holds its graph and its module-output gradients (work) next to micro-batch 1's I
    sch = build_schedule("zero_bubble", 2, 4)
    w0, w1 = (schedule_peak(sch, r, {r: StageBytes(keep=1.0, backward=0.0, work=10.0)}) for r in range(2))
    assert (w0.peak, w1.peak) == (12.0, 22.0), (w0, w1)  # rank 0: F(m+1) live + the I's work; rank 1: 1 + 10 + 1 + 10
    assert w1.at == "I(s1,m1)", w1
    # the I's working set is the larger of its backward and the gradients it makes, not their sum
    assert schedule_peak(sch, 0, {0: StageBytes(keep=1.0, backward=4.0, work=10.0)}).peak == 12.0


def test_split_backward_widths_of_gpt_stages():
    from lightning_scale.models.gpt import GPT, Block, GPTConfig
    from lightning_scale.pipeline.layers import gpt_pipeline_layers
    from lightning_scale.pipeline_plan import split_backward_width

    d, V = 32, 96
    layers = list(gpt_pipeline_layers(GPT(GPTConfig(vocab_size=V, seq_len=16, n_layer=2, n_head=2, d_model=d))))
    # stage 0: wte, wpe (d each, neither saved) + a block's ln1 d, qkv 3d, proj d, ln2 d, fc 4d, proj d = 11 d
    assert split_backward_width(layers[:2], Block) == (13.0 * d, 2.0 * d)
    # the last stage: a block + ln_f d + the head's V logits, which no op saves (the loss keeps its log-softmax)
    assert split_backward_width(layers[2:], Block, last=True) == (12.0 * d + V, float(V))
    tied = list(gpt_pipeline_layers(GPT(GPTConfig(vocab_size=V, seq_len=16, n_layer=1, n_head=2, d_model=d,
                                                  tie_weights=True))))
    assert split_backward_width(tied, Block, last=True) == (0.0, 0.0)  # two owners: the whole backward runs in I


def test_zero_bubble_stage_keeps_records_and_work():
    sch = build_schedule("zero_bubble", 2, 4)
    prof = {"saved": 1000.0, "input": 100.0, "selective": 300.0, "backward": 200.0, "recorded": 40.0}
    common = dict(schedule=sch, seq_len=64, micro_batch=1, per_token=prof, hidden=32, vocab=128, precision="32-true")
    plain = pipeline_activations(pp_rank=0, units={0: 2}, **common)
    split = pipeline_activations(pp_rank=0, units={0: 2}, split_widths={0: (100.0, 8.0)}, **common)
    keep = 64 * 2 * 1000.0
    extra = 64 * (8.0 * 4 + 2 * 40.0)  # the unsaved embedding outputs + the units' recorded outputs
    work = 64 * 100.0 * 4
    # both peak at I(s0,m1) with the same p2p buffers: two micro-batches live, one backward's working set
    assert plain.pipeline.at == split.pipeline.at == "I(s0,m1)" and plain.pipeline.p2p == split.pipeline.p2p
    assert plain.pipeline.peak - plain.pipeline.p2p == 2 * keep + 64 * 200.0, plain.pipeline
    assert split.pipeline.peak - split.pipeline.p2p == 2 * (keep + extra) + work, split.pipeline
    # a stage of checkpointed units is not split (WeightGradSplitter): its walk is 1F1B + AC's, I freeing the keep
    for r in (0, 1):
        ac = pipeline_activations(pp_rank=r, units={r: 2}, activation_checkpointing="full",
                                  split_widths={r: (100.0, 8.0)}, **dict(common, schedule=build_schedule("zero_bubble", 2, 4)))
        ref = pipeline_activations(pp_rank=r, units={r: 2}, activation_checkpointing="full",
                                   **dict(common, schedule=build_schedule("1f1b", 2, 4)))
        assert any("not split" in n for n in ac.notes), ac.notes
        assert (ac.pipeline.peak, ac.pipeline.p2p, ac.pipeline.kept, ac.pipeline.max_in_flight) == \
            (ref.pipeline.peak, ref.pipeline.p2p, ref.pipeline.kept, ref.pipeline.max_in_flight), (ac.pipeline, ref.pipeline)
        assert ac.pipeline.max_in_flight == 2 - r
