"""ZeRO-3 parameters between steps (2 gloo ranks, float64 GPT): reading a freed parameter raises an error naming
it (it used to segfault), and ``ShardedParameters.gathered(module)`` gives the full values, equal to the
single-process model trained on the same batches; the weight-norm callback pattern of docs/failures.md."""

from __future__ import annotations

import torch

from lightning_scale.testing import run_distributed

STEPS, BATCH = 2, 4


def _worker(rank: int, world: int):
    import zero_workers as W
    from zero3_workers import _gpt

    from lightning_scale.models.gpt import lm_loss, make_batch
    from lightning_scale.zero.param_guard import ShardedParameterAccessError
    from lightning_scale.zero.param_shard import ShardedParameters
    from lightning_scale.zero.stage3_optimizer import Stage3Optimizer

    model, cfg = _gpt()
    opt = W.make_optimizer(model)
    sharded = ShardedParameters(model, [g["params"] for g in opt.param_groups], device=torch.device("cpu"),
                                param_dtype=torch.float64)
    sharded.shard_model()
    Stage3Optimizer(opt, sharded)
    local = BATCH // world
    for step in range(STEPS):
        x, y = make_batch(cfg, BATCH, seed=1000 * step)
        lm_loss(model(x[rank * local:(rank + 1) * local]), y[rank * local:(rank + 1) * local]).backward()
        opt.step()
        opt.zero_grad()
    weight = model.blocks[0].attn.qkv.weight if hasattr(model.blocks[0], "attn") else next(model.blocks[0].parameters())
    errors = []
    for read in (lambda: weight.norm(), lambda: weight.sum().item(), lambda: weight.data.clone(), lambda: repr(weight)):
        try:
            read()
            errors.append(None)
        except ShardedParameterAccessError as err:
            errors.append(str(err))
    meta_ok = (tuple(weight.shape), weight.dtype, weight.requires_grad, weight.numel())
    with sharded.gathered(model.blocks[0]):  # one unit; the callback pattern: norms of every gathered weight
        one = {n: p.detach().clone() for n, p in model.blocks[0].named_parameters()}
    with sharded.gathered():
        norms = {n: float(p.norm()) for n, p in model.named_parameters()}
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    left = sharded.gathered_bytes() - sharded.memory_bytes()["persistent"]
    after = None
    try:
        weight.norm()
    except ShardedParameterAccessError:
        after = "freed again"
    # still trains after the context (hooks and classes restored)
    x, y = make_batch(cfg, BATCH, seed=77)
    loss = float(lm_loss(model(x), y))
    return errors, meta_ok, one, norms, full, after, loss, left


def test_freed_parameter_read_raises_and_gathered_context_matches_single_process():
    from zero3_workers import reference_gpt

    results = run_distributed(_worker, 2, timeout=180)
    ref = reference_gpt(STEPS, 1, BATCH, 0.0)
    for errors, meta_ok, one, norms, full, after, loss, gathered in results:
        assert all(e is not None and "zero.stage=3: parameter 'blocks.0." in e and "gathered(" in e for e in errors), errors
        assert meta_ok[1] == torch.float64 and meta_ok[2] and meta_ok[3] == torch.Size(meta_ok[0]).numel()
        assert set(full) == set(ref)
        for n, p in ref.items():
            torch.testing.assert_close(full[n], p, rtol=0, atol=1e-12)
            assert abs(norms[n] - float(p.norm())) < 1e-9
        for n, p in one.items():
            torch.testing.assert_close(p, ref[f"blocks.0.{n}"], rtol=0, atol=1e-12)
        assert after == "freed again" and gathered == 0  # only the persistent unit stays gathered
    assert results[0][6] == results[1][6]  # the same loss on both ranks after the context
