"""The composition core in a plain torch.distributed script: parallelize() + make_engines(), no Lightning.

* dp=2 x tp=2 at ZeRO stage 3 from a meta-device model: parameters, losses and norms equal one process (float64).
* The one cross-axis module at dp=2 x pp=2 x tp=2 (8 ranks, tied embedding / head, tp-replicated LayerNorms):
  every rank's global gradient norm equals the single-process norm (1e-12, float64), and an inf on one rank's
  gradient is one overflow vote: every rank skips.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_scale.testing import run_distributed

MODEL = dict(n_layer=2, vocab_size=64, seq_len=16)
STEPS, BATCH, CLIP, LR = 3, 4, 0.5, 3e-3


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _reference(tie: bool):
    from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch

    torch.manual_seed(0)
    model = GPT(gpt_tiny(tie_weights=tie, **MODEL)).double()
    opt = torch.optim.AdamW(_groups(model), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = make_batch(gpt_tiny(**MODEL), BATCH, seed=step)
        loss = model.loss(x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _stage3_tp_worker(rank: int, world_size: int):
    from lightning_scale.comm import collectives as C
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(stage=3, tp=2)
    topo = local_topology(config, world_size, rank)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(gpt_tiny(**MODEL)).double()
    opt = torch.optim.AdamW(_groups(model), lr=LR)  # over the meta parameters: remapped by name
    pm = parallelize(model, config, topo, "cpu", optimizers=[opt])
    (engine,) = pm.make_engines()
    losses, norms = [], []
    for step in range(STEPS):
        x, y = make_batch(gpt_tiny(**MODEL), BATCH, seed=step)
        xs, ys = x.chunk(topo.dp)[topo.dp_rank], y.chunk(topo.dp)[topo.dp_rank]  # tp peers: the same rows
        loss = model.loss(xs, ys)
        loss.backward()
        norms.append(engine.clip_grad_norm_(CLIP).item())
        opt.step()  # routed to the engine
        opt.zero_grad()
        C.all_reduce(mean := loss.detach().clone(), topo.dp_group)
        losses.append(mean.item() / topo.dp)
    full = pm.consolidate_stage3(pm.sharded.full_state_dict(dtype=None))
    return {"losses": losses, "norms": norms, "state": {k: v.clone() for k, v in full.items()},
            "engine": type(engine).__name__}


@pytest.mark.timeout(300)
def test_plain_script_parallelize_dp2_tp2_stage3_matches_one_process():
    ref_losses, ref_norms, ref_state = _reference(tie=False)
    results = run_distributed(_stage3_tp_worker, 4, timeout=240)
    for rank, res in enumerate(results):
        assert res["engine"] == "Stage3Optimizer"
        assert max(abs(a - b) for a, b in zip(res["losses"], ref_losses)) < 1e-10, (rank, res["losses"])
        assert max(abs(a - b) for a, b in zip(res["norms"], ref_norms)) < 1e-10, (rank, res["norms"])
        assert sorted(res["state"]) == sorted(ref_state)
        worst = max((res["state"][k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < 1e-10, (rank, worst)


def _cross_axis_worker(rank: int, world_size: int):
    """3D: one pipeline step of every micro-batch, then the engines' global norm and the overflow vote."""
    import contextlib

    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(stage=1, tp=2, pp=2, microbatches=2, overlap_comm=False)
    topo = local_topology(config, world_size, rank)
    torch.manual_seed(0)
    model = GPT(gpt_tiny(tie_weights=True, **MODEL)).double()
    opt = torch.optim.AdamW(_groups(model), lr=LR)
    from lightning_scale.tensor_parallel import tensor_parallel_state

    def loss_fn(logits, targets):  # the head is split over the vocabulary: the vocab-parallel cross-entropy
        return tensor_parallel_state(model).cross_entropy(logits, targets)

    pm = parallelize(model, config, topo, "cpu", optimizers=[opt], loss_fn=loss_fn)
    (engine,) = pm.make_engines(overlap_comm=False)
    x, y = make_batch(gpt_tiny(**MODEL), BATCH, seed=0)
    xs, ys = x.chunk(topo.dp)[topo.dp_rank], y.chunk(topo.dp)[topo.dp_rank]
    with contextlib.ExitStack() as stack:
        stack.enter_context(engine.no_sync())
        pm.pipeline.runtime.train_step(xs, ys)
    norm = engine.global_grad_norm().item()
    vote_plain = engine.reduce_gradients()
    engine.zero_grad()
    # the overflow vote: an inf on one rank's gradient (dp 0, pp 1, tp 1) skips the step everywhere
    from lightning_scale.config import LossScaleConfig
    from lightning_scale.zero.precision import DynamicLossScaler

    engine.loss_scaler = DynamicLossScaler(LossScaleConfig(initial_scale=1.0))
    with contextlib.ExitStack() as stack:
        stack.enter_context(engine.no_sync())
        pm.pipeline.runtime.train_step(xs, ys)
    if (topo.dp_rank, topo.pp_rank, topo.tp_rank) == (0, 1, 1):
        next(p for p in pm.pipeline.stage.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    vote = engine.reduce_gradients()
    return {"norm": norm, "vote_plain": vote_plain, "vote": vote,
            "coords": (topo.dp_rank, topo.pp_rank, topo.tp_rank)}


@functools.lru_cache(maxsize=None)
def _single_norm() -> float:
    from lightning_scale.models.gpt import GPT, gpt_tiny, lm_loss, make_batch

    torch.manual_seed(0)
    model = GPT(gpt_tiny(tie_weights=True, **MODEL)).double()
    x, y = make_batch(gpt_tiny(**MODEL), BATCH, seed=0)
    loss = sum(lm_loss(model(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2  # 2 micro-batches
    loss.backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()


@pytest.mark.timeout(400)
def test_cross_axis_norm_and_overflow_vote_at_dp2_pp2_tp2():
    expected = _single_norm()
    results = run_distributed(_cross_axis_worker, 8, timeout=360)
    assert sorted(r["coords"] for r in results) == sorted((d, p, t) for d in range(2) for p in range(2)
                                                          for t in range(2))
    for res in results:
        assert abs(res["norm"] - expected) < 1e-12 * max(1.0, expected), (res["coords"], res["norm"], expected)
        assert res["vote_plain"] is False and res["vote"] is True, res
