"""The last stage's loss hand-out cannot hang or cross runtimes: runtimes one after another in one process group.

The last stage sends each step's mean loss to the other pipeline ranks and does not wait for it (its train_step
returns while stage 0 still runs its last backward). 266806c's version hung tests/dist/test_pipeline_trace.py 4
times of 4 in a clean-clone CI run: the first send on a channel carried a shape header whose send handle lived
only in the runtime's P2P; a runtime dropped after one step freed it before stage 0 had posted its receive, and a
freed gloo send never arrives, so stage 0 blocked in that receive while the last stage had finished.

One spawned 2-rank run builds RUNTIMES runtimes in turn on the same pipeline group, 1, 2 or 3 train steps each (the
one-step runtimes are the ones 266806c lost), some with an eval step last; stage 0's backward sleeps so that the
last stage is always ahead, and every rank drops each runtime (and collects garbage) right after its last step.
Both ranks must return the same losses for every step of every runtime, within run_distributed's timeout (a
lost or crossed message is a hang there, or a loss from the wrong step).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
from lightning_scale.testing import run_distributed

RUNTIMES, BATCH, MICRO, SEED, SLOW_B_S = 7, 4, 2, 3, 0.02


def _loss64(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _worker(rank: int, world_size: int) -> list:
    import gc
    import time

    from lightning_scale.pipeline import PipelineRuntime, build_stage, gpt_pipeline_layers
    from lightning_scale.topology import Topology

    topo = Topology(pp=world_size, rank=rank).build_groups()
    cfg = gpt_tiny(n_layer=2, tie_weights=False)
    out = []
    for n in range(RUNTIMES):
        torch.manual_seed(SEED + n)
        stage = build_stage(gpt_pipeline_layers(GPT(cfg).double()), pp=topo.pp, pp_rank=topo.pp_rank)
        if rank == 0:
            def slow(module, args, output):  # the backward through stage 0's output sleeps (eval: no backward)
                if output.requires_grad:
                    output.register_hook(lambda grad: (time.sleep(SLOW_B_S), grad)[1])
            stage.chunk(0).register_forward_hook(slow)
        rt = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=_loss64,
                             microbatches=MICRO, schedule="1f1b" if n % 2 else "gpipe")
        for k in range(1 + n % 3):
            out.append((n, "train", k, rt.train_step(*make_batch(cfg, BATCH, seed=10 * n + k))))
        if n % 3 == 2:
            out.append((n, "eval", 0, rt.eval_step(*make_batch(cfg, BATCH, seed=99))))
        del rt, stage
        gc.collect()
    return out


@pytest.mark.slow  # 18 s at load ~20
def test_runtimes_in_turn_hand_out_every_loss_to_every_rank():
    first, last = run_distributed(_worker, 2, timeout=120)
    assert len(first) == len(last) == sum(1 + n % 3 + (n % 3 == 2) for n in range(RUNTIMES))
    for a, b in zip(first, last):
        assert a[:3] == b[:3] and torch.equal(a[3], b[3]), (a, b)
    # the losses are the steps' own: distinct batches and models give distinct values
    assert len({float(x[3]) for x in last}) == len(last)


def test_exit_wait_for_detached_sends_is_bounded_and_swallows_errors():
    """At interpreter exit the detached sends get a bounded wait in all (not the group's 30 min timeout: a hung peer
    must not hold the exit), errors of a dead peer are swallowed, and nothing is left in the list."""
    import datetime

    from lightning_scale.comm import p2p

    seen = []

    class _Work:
        def __init__(self, fail):
            self.fail = fail

        def wait(self, timeout):
            seen.append(timeout)
            if self.fail:
                raise RuntimeError("Connection closed by peer")

    before = list(p2p._DETACHED)
    try:
        p2p._DETACHED[:] = [p2p.PendingRecv(torch.zeros(1), _Work(k == 0), None) for k in range(3)]
        p2p._wait_detached_at_exit(bound_s=2.0)
        assert p2p._DETACHED == [] and len(seen) == 3
        assert all(isinstance(t, datetime.timedelta) and t <= datetime.timedelta(seconds=2.0) for t in seen), seen
    finally:
        p2p._DETACHED[:] = before
