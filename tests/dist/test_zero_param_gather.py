"""Stages 1-2: the post-step all-gather stays in flight into the next forward, with results bit-identical to the
blocking path, and no read between steps (eval, state_dict, a checkpoint) sees a stale parameter."""

import time

import torch

from lightning_scale.models.gpt import GPT, gpt_tiny, lm_loss, make_batch
from lightning_scale.testing import run_distributed
from lightning_scale.zero import ZeroOptimizer

STEPS, BATCH, CLIP, DELAY_S = 3, 8, 0.5, 0.4


def _train(rank: int, world: int, stage: int, overlap: bool):
    """float64, 3 steps with clipping and an eval forward between steps. Rank 1 lingers before the step() of steps
    1 and 2 (its gradients are already reduced), so rank 0's gathers of those steps cannot finish for a while."""
    torch.manual_seed(0)
    cfg = gpt_tiny()
    model = GPT(cfg).double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    zero = ZeroOptimizer(opt, stage=stage, bucket_mb=0.01, overlap_param_gather=overlap)
    events, seen = [], {}
    zero.gathers.on_event = lambda kind, bucket: events.append((kind, bucket, time.perf_counter()))
    model.register_forward_pre_hook(lambda m, a: seen.setdefault("forward", time.perf_counter()) and None)
    local = BATCH // world
    losses, evals = [], []
    for step in range(STEPS):
        x, y = make_batch(cfg, BATCH, seed=step)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        seen.clear()
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        zero.clip_grad_norm_(CLIP)
        if step >= 1 and rank == 1:
            time.sleep(DELAY_S)
        opt.step()
        opt.zero_grad()
        if step == 0:
            with torch.no_grad():  # eval between steps reads the freshly stepped parameters
                evals.append(lm_loss(model(x), y).item())
        if step == 1:
            in_flight_after_step = zero.gathers.in_flight()
            mark = len(events)
            # A read between steps (state_dict, logging): waits for its bucket, sees the new values.
            snapshot = {k: v.clone() for k, v in model.state_dict().items()}
            zero.wait_params()
            stale = [k for k, v in model.state_dict().items() if not torch.equal(v, snapshot[k])]
            step1_events = events[mark:]
    # The next forward starts while step 2's gathers are still running (rank 1 has not joined them yet).
    x, y = make_batch(cfg, BATCH, seed=STEPS)
    seen.clear()
    pending_at_forward = []
    model.register_forward_pre_hook(
        lambda m, a: pending_at_forward.extend(b for b in zero.gathers.in_flight() if not zero.gathers.is_completed(b)))
    mark = len(events)
    final_loss = lm_loss(model(x), y).item()
    forward_events = events[mark:]
    state = zero.state_dict()  # a checkpoint: waits for every gather first
    left = zero.gathers.in_flight()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(params=params, losses=losses, evals=evals, final_loss=final_loss, stale=stale,
                in_flight_after_step=in_flight_after_step, step1_events=step1_events,
                pending_at_forward=pending_at_forward, forward_start=seen.get("forward"),
                forward_events=forward_events, left_after_state_dict=left, n_buckets=len(zero.buckets),
                state_keys=sorted(state))


def both_paths(rank: int, world: int):
    return {(stage, overlap): _train(rank, world, stage, overlap) for stage in (1, 2) for overlap in (True, False)}


def test_background_gather_is_bit_identical_and_never_read_stale():
    results = run_distributed(both_paths, 2, timeout=240)
    for rank, per_run in enumerate(results):
        for stage in (1, 2):
            bg, blocking = per_run[(stage, True)], per_run[(stage, False)]
            assert bg["n_buckets"] > 3
            for name in blocking["params"]:
                assert torch.equal(bg["params"][name], blocking["params"][name]), (rank, stage, name)
            assert bg["losses"] == blocking["losses"] and bg["evals"] == blocking["evals"]
            assert bg["final_loss"] == blocking["final_loss"]
            assert bg["stale"] == [] and blocking["stale"] == []
            assert bg["left_after_state_dict"] == [] and "inner" in bg["state_keys"]
            # The blocking path waits inside step(): nothing is in flight afterwards.
            assert blocking["in_flight_after_step"] == [] and blocking["pending_at_forward"] == []
            if rank != 0:
                continue
            # Rank 0 left step 1 with every bucket's gather in flight (rank 1 had not joined them yet) ...
            assert bg["in_flight_after_step"] == list(range(bg["n_buckets"])), bg["in_flight_after_step"]
            # ... and the next forward started while they were still running; each bucket was waited for inside
            # that forward, the first one when the forward first read one of its parameters.
            assert len(bg["pending_at_forward"]) == bg["n_buckets"], bg["pending_at_forward"]
            waits = [(b, t) for kind, b, t in bg["forward_events"] if kind == "wait_end"]
            assert sorted(b for b, _ in waits) == list(range(bg["n_buckets"]))
            assert all(t > bg["forward_start"] for _, t in waits)
            first_wait = min(t for kind, _, t in bg["forward_events"] if kind == "wait_begin")
            assert first_wait >= bg["forward_start"]
