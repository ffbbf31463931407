"""Tiled MLP through parallelize() on 2 gloo ranks (issue 16), float64, 3 AdamW steps: dp2 at ZeRO 2 and ZeRO 3 (+ full
activation checkpointing), tp=2 (the GPT's column / row split MLP and HF Llama's gate/up/down), sp=2 (tiles of each
rank's L / sp positions) and pp=2: losses and parameters equal one untiled process within 1e-10. ZeRO-3's
reduce-scatter and the ZeRO-2 buckets fire from the gradient-ready hooks, so a tile that reached them more than once
would show here as a wrong gradient or a hang.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import run_distributed
from test_ulysses import LR, STEPS, _batch, _build, _loss, _reference, _reference_loss

TILE = 4  # GPT_MODEL / LLAMA_SEQ: 16 positions -> 4 tiles (2 per sp rank)
MICRO = 2


def _train_one(rank: int, world_size: int, family: str, inspect=None, **options):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models.gpt import lm_loss
    from lightning_scale.parallelize import local_topology, parallelize
    from lightning_scale.sequence_parallel import shard_sequence
    from lightning_scale.tiled_mlp import tiled_mlps

    options.setdefault("tiled_mlp", TILE)
    config = from_flat_kwargs(**options)
    topo = local_topology(config, world_size, rank)
    hf = family.startswith("llama")
    model = _build(family, meta=not hf and config.zero.stage == 3)
    loss_fn = lm_loss
    pm = parallelize(model, config, topo, "cpu", optimizers=lambda: [torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR)], loss_fn=loss_fn)
    assert tiled_mlps(model) or not config.tiled_mlp, "nothing tiled"
    if inspect is not None:
        inspect(model)
    (engine,) = pm.make_engines()
    losses = []
    for step in range(STEPS):
        x, y = _batch(family, step)
        x, y = x.chunk(topo.dp)[topo.dp_rank], y.chunk(topo.dp)[topo.dp_rank]
        x, y = shard_sequence((x, y), topo.sp_rank, topo.sp)
        if pm.pipeline is not None:
            with engine.no_sync():
                loss = pm.pipeline.runtime.train_step(x, y).to(torch.float64)
        else:
            # HF's own loss casts the logits to fp32: the reference's float64 loss on the logits (no sp here)
            loss = _reference_loss(family, model, x, y) if hf and topo.sp == 1 else _loss(family, model, x, y)
            loss.backward()
        engine.step()
        engine.zero_grad()
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
        torch.distributed.all_gather(every, loss.detach().to(torch.float64).reshape(1))
        losses.append([float(t) for t in every])
    if pm.sharded is not None:
        state = pm.consolidate_stage3(pm.sharded.full_state_dict(dtype=None))
    else:
        state = pm.full_state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}


CASES = [("gpt", (("stage", 2),)), ("gpt", (("stage", 3), ("activation_checkpointing", "full"))),
         ("gpt", (("tp", 2), ("stage", 1))), ("llama-sdpa", (("tp", 2), ("stage", 0))),
         ("gpt", (("sp", 2), ("stage", 3))), ("gpt", (("pp", 2), ("microbatches", MICRO), ("stage", 1)))]


def _train(rank: int, world_size: int):
    return {case: _train_one(rank, world_size, case[0], **dict(case[1])) for case in CASES}


@pytest.mark.slow  # six layouts on 2 ranks: ~50 s on the loaded box
@pytest.mark.timeout(300)
def test_tiled_mlp_under_zero_tp_sp_pp_matches_one_untiled_process():
    results = run_distributed(_train, 2, timeout=260)[0]
    for case in CASES:
        family, options = case[0], dict(case[1])
        losses, state = results[case]
        dp = 2 if all(options.get(k, 1) == 1 for k in ("tp", "sp", "pp")) else 1
        ref_losses, ref_state = _reference(family, MICRO if options.get("pp", 1) > 1 else dp)
        for every, ref in zip(losses, ref_losses):
            mean = sum(every) / len(every) if dp > 1 else None
            assert (abs(mean - ref) if dp > 1 else max(abs(v - ref) for v in every)) < 1e-10, (case, every, ref)
        assert set(ref_state) <= set(state), case
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < 1e-10, (case, worst)


def assert_matches_reference(results, cases, tol=1e-10):
    """Every case's losses (the dp mean at dp=2, each rank's otherwise) and parameters equal one process's."""
    for case in cases:
        options = dict(case[1])
        losses, state = results[case]
        dp = 2 if all(options.get(k, 1) == 1 for k in ("tp", "sp", "pp")) else 1
        ref_losses, ref_state = _reference(case[0], MICRO if options.get("pp", 1) > 1 else dp)
        for every, ref in zip(losses, ref_losses):
            got = sum(every) / len(every) if dp > 1 else max(every, key=lambda v: abs(v - ref))
            assert abs(got - ref) < tol, (case, every, ref)
        assert set(ref_state) <= set(state), case
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < tol, (case, worst)
