"""Pipeline sends never hold up a stage's next compute (from the runtime's trace), and the asynchronous path is
bit-identical to the blocking one.

One spawned 2-rank run trains a tiny float64 GPT for 2 AdamW steps with 1F1B and with GPipe, each twice: the
default asynchronous runtime and ``blocking=True`` (every send waited before the rank's next compute, no receive
prefetched), both with ``trace=True``. Per rank and schedule:

* the trace is complete: one F and one B per (stage, micro-batch), one send_post / send_wait per SEND action, one
  recv_post / recv_wait per RECV action;
* asynchronous: no send's wait starts before the compute that follows its post has started (the stage went on
  computing while its send was in flight); the schedule never needs a send finished mid-step, so this holds for
  every send;
* blocking: the same check finds every send with a later compute (so the check can tell the two apart);
* parameters and losses after the steps are equal bit for bit (torch.equal) between the two paths;
* with tracing off (default) ``last_trace`` stays empty.

A second run (stage 0's backward slowed) checks that the last stage's train_step returns before stage 0's last
backward has ended: it hands the mean loss out without waiting for it to be received.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
from lightning_scale.testing import run_distributed

STEPS, BATCH, MICRO, SEED = 2, 8, 4, 7


def _loss64(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _worker(rank: int, world_size: int) -> dict:
    from lightning_scale.pipeline import PipelineRuntime, build_stage, gpt_pipeline_layers
    from lightning_scale.pipeline import schedule as S
    from lightning_scale.topology import Topology

    topo = Topology(pp=world_size, rank=rank).build_groups()
    cfg = gpt_tiny(n_layer=4, tie_weights=False)
    out = {}
    for schedule in ("1f1b", "gpipe"):
        for blocking in (False, True):
            torch.manual_seed(SEED)
            gpt = GPT(cfg).double()
            stage = build_stage(gpt_pipeline_layers(gpt), pp=topo.pp, pp_rank=topo.pp_rank)
            rt = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=_loss64,
                                 microbatches=MICRO, schedule=schedule, trace=True, blocking=blocking)
            opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
            losses, traces = [], []
            for k in range(STEPS):
                losses.append(rt.train_step(*make_batch(cfg, BATCH, seed=k)))
                traces.append(list(rt.last_trace))
                opt.step()
                opt.zero_grad(set_to_none=True)
            acts = rt.schedule.actions[topo.pp_rank]
            counts = {kind: sum(a.kind == kind for a in acts) for kind in (S.SEND_F, S.SEND_B, S.RECV_F, S.RECV_B)}
            mine = {id(p) for p in stage.parameters()}
            out[(schedule, blocking)] = dict(
                losses=losses, traces=traces, counts=counts, stage_ids=list(stage.stage_ids),
                params={n: p.detach().clone() for n, p in gpt.named_parameters() if id(p) in mine})
    torch.manual_seed(SEED)
    stage = build_stage(gpt_pipeline_layers(GPT(cfg).double()), pp=topo.pp, pp_rank=topo.pp_rank)
    rt = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=_loss64,
                         microbatches=MICRO, schedule="1f1b")
    rt.train_step(*make_batch(cfg, BATCH, seed=0))
    out["untraced"] = list(rt.last_trace)
    return out


def _check_complete(run: dict) -> None:
    for events in run["traces"]:
        by = {}
        for e in events:
            by.setdefault(e.action, []).append(e)
            assert e.t_end >= e.t_start, e
        for s in run["stage_ids"]:
            for kind in ("F", "B"):
                assert sorted(e.microbatch for e in by[kind] if e.stage == s) == list(range(MICRO)), (kind, s)
        sends = run["counts"]["SEND_F"] + run["counts"]["SEND_B"]
        recvs = run["counts"]["RECV_F"] + run["counts"]["RECV_B"]
        assert len(by.get("send_post", [])) == len(by.get("send_wait", [])) == sends
        assert len(by.get("recv_post", [])) == len(by.get("recv_wait", [])) == recvs


def test_sends_never_delay_the_next_compute_and_async_equals_blocking():
    from lightning_scale.pipeline.runtime_trace import COMPUTE, sends_waited_before_next_compute

    results = run_distributed(_worker, 2, timeout=240)
    for rank, res in enumerate(results):
        assert res["untraced"] == [], "tracing must be off by default"
        for schedule in ("1f1b", "gpipe"):
            fast, slow = res[(schedule, False)], res[(schedule, True)]
            _check_complete(fast)
            _check_complete(slow)
            for events in fast["traces"]:
                bad = sends_waited_before_next_compute(events)
                assert bad == [], f"rank {rank} {schedule}: a send's wait came before the next compute: {bad[:2]}"
            for events in slow["traces"]:
                # blocking: every send that some compute follows was waited before that compute
                computes = [e for e in events if e.action in COMPUTE]
                later = [p for p in events if p.action == "send_post" and any(c.t_start >= p.t_end for c in computes)]
                assert later and len(sends_waited_before_next_compute(events)) == len(later)
            assert len(fast["losses"]) == len(slow["losses"]) == STEPS
            for a, b in zip(fast["losses"], slow["losses"]):
                assert torch.equal(a, b), (schedule, a, b)
            assert fast["params"].keys() == slow["params"].keys() and fast["params"]
            for name, p in fast["params"].items():
                assert torch.equal(p, slow["params"][name]), f"rank {rank} {schedule}: {name} differs"


SLOW_BACKWARD_S = 0.5


def _slow_first_stage_worker(rank: int, world_size: int) -> dict:
    """1F1B on 2 ranks whose stage 0 backward sleeps: the last stage finishes its schedule long before stage 0's
    last backward. Returns, per step, when train_step returned, the end of stage 0's last B (rank 0) and the loss."""
    import time

    from lightning_scale.pipeline import PipelineRuntime, build_stage, gpt_pipeline_layers
    from lightning_scale.topology import Topology

    topo = Topology(pp=world_size, rank=rank).build_groups()
    cfg = gpt_tiny(n_layer=4, tie_weights=False)
    torch.manual_seed(SEED)
    stage = build_stage(gpt_pipeline_layers(GPT(cfg).double()), pp=topo.pp, pp_rank=topo.pp_rank)
    if rank == 0:
        def slow(module, args, output):  # the backward through stage 0's output sleeps
            output.register_hook(lambda grad: (time.sleep(SLOW_BACKWARD_S / MICRO), grad)[1])
        stage.chunk(0).register_forward_hook(slow)
    rt = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=_loss64,
                         microbatches=MICRO, schedule="1f1b", trace=True)
    out = []
    for k in range(STEPS):
        loss = rt.train_step(*make_batch(cfg, BATCH, seed=k))
        returned = time.perf_counter()
        last_b = max((e.t_end for e in rt.last_trace if e.action == "B" and e.stage == 0), default=None)
        out.append((returned, last_b, loss))
    rt.close()
    return out


@pytest.mark.slow  # 2 x 4 sleeps of 0.125 s + spawning: ~10-20 s at load ~20
def test_last_stage_does_not_wait_for_the_others_to_receive_the_loss():
    """The last stage sends the mean loss without waiting for the other ranks to receive it: its train_step
    returns before stage 0 has finished its last backward (a blocking broadcast could not: stage 0 reaches the
    broadcast only after that backward). Causal order read off perf_counter stamps of one host; the losses
    still agree on both ranks."""
    first, last = run_distributed(_slow_first_stage_worker, 2, timeout=240)
    for k, ((_, last_b, loss0), (returned, _, loss1)) in enumerate(zip(first, last)):
        assert torch.equal(loss0, loss1), (k, loss0, loss1)
        assert returned < last_b, f"step {k}: the last stage returned {returned - last_b:.3f} s after stage 0's last B"
