"""Ulysses sequence parallelism composed with tensor parallelism (issue 16: "sp x tp on 4 ranks"), float64, 3 AdamW
steps through parallelize() on gloo ranks.

* tp=2 x sp=2 (4 ranks): tp splits the heads first (2 of 4 per tp rank), the all-to-all splits each tp rank's heads
  over its sp group (1 per rank). The project GPT (vocabulary-parallel chunked loss, ignored targets), a tiny Hugging
  Face Llama (rotary, grouped-query: its 2 key/value heads are split by tp, one per tp rank, repeated for sp; sdpa and
  eager) and the GPT with a block-sparse core (a BigBird layout that differs per head: each rank's head of the whole
  model's layout), at ZeRO 0 and 3: losses and parameters equal one process on the full sequences within 1e-10.
* pp=2 x sp=2 (4 ranks): every pipeline stage's attention runs Ulysses over its sp group, micro-batches carry L / sp
  and the last stage's loss is each micro-batch's whole-sequence mean: the GPT (1f1b at ZeRO 0 and 3, gpipe at ZeRO 1,
  zero-bubble, block-sparse), and through the Hugging Face pipeline adapter Llama (rotary: sdpa at ZeRO 0, eager at
  ZeRO 3) and GPT-2 (learned positions, tied head: ZeRO 1), equal one process within 1e-10. Padding masks and
  sliding windows under sp x pp: tests/dist/test_ulysses_masks.py.
* sp=2 x tp=2 x pp=2 (8 ranks, slow): the GPT (1f1b ZeRO 0, gpipe ZeRO 1) and HF Llama through the pipeline adapter
  equal one process within 1e-10.
* Bad splits are ConfigErrors naming sp and tp, on every rank: sp x tp above the head count, sp not dividing the heads
  of a tp rank; and tp's own sequence split (tensor.sequence_parallel) under sp.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed
from test_ulysses import LR, STEPS, _batch, _build, _loss, _reference


def _train_one(rank: int, world_size: int, family: str, tp: int, sp: int, stage: int, pp: int = 1,
               schedule: str = "1f1b"):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models.gpt import lm_loss
    from lightning_scale.parallelize import local_topology, parallelize
    from lightning_scale.sequence_parallel import shard_sequence

    pipe = dict(pp=pp, microbatches=MICRO, schedule=schedule) if pp > 1 else {}
    config = from_flat_kwargs(sp=sp, tp=tp, stage=stage, **pipe)
    topo = local_topology(config, world_size, rank)
    hf = family.startswith(("llama", "gpt2"))
    model = _build(family, meta=not hf and (stage == 3 or tp > 1 or pp > 1))
    loss_fn = lm_loss
    if pp > 1 and tp > 1 and not hf:  # the GPT's head is split over the vocabulary: its vocab-parallel loss
        from lightning_scale.tensor_parallel import tensor_parallel_state

        def loss_fn(logits, targets):
            return tensor_parallel_state(model).cross_entropy(logits, targets)
    pm = parallelize(model, config, topo, "cpu", optimizers=lambda: [torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR)], loss_fn=loss_fn)
    (engine,) = pm.make_engines()
    losses = []
    for step in range(STEPS):
        x, y = _batch(family, step)
        x, y = x.chunk(topo.dp)[topo.dp_rank], y.chunk(topo.dp)[topo.dp_rank]
        if pp > 1 and hf:  # the pipeline's loss_fn takes next-token targets: shift the labels before the cut
            y = torch.cat([y[:, 1:], torch.full_like(y[:, :1], -100)], dim=1)
        x, y = shard_sequence((x, y), topo.sp_rank, topo.sp)
        if pm.pipeline is not None:  # micro-batches of (B / M, L / sp); the mean of their whole-sequence losses
            with engine.no_sync():
                loss = pm.pipeline.runtime.train_step(x, y).to(torch.float64)
        else:
            loss = _loss(family, model, x, y)
            loss.backward()
        engine.step()
        engine.zero_grad()
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
        torch.distributed.all_gather(every, loss.detach().reshape(1))
        losses.append([float(t) for t in every])
    if pm.sharded is not None:
        state = pm.consolidate_stage3(pm.sharded.full_state_dict(dtype=None))
    else:
        state = pm.full_state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}


def _train(rank: int, world_size: int, cases):
    out = {case: _train_one(rank, world_size, *case) for case in cases}
    return out, _bad_splits(rank, world_size)


def _bad_splits(rank: int, world_size: int):
    """sp x tp = 4 > 2 heads; 6 heads / tp=2 = 3 per tp rank, which sp=2 does not divide (the GPT and HF Llama)."""
    from lightning_scale.config import ConfigError, from_flat_kwargs
    from lightning_scale.models.gpt import GPT, gpt_tiny
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(sp=2, tp=2)
    topo = local_topology(config, world_size, rank)
    messages = []
    for build in (lambda: GPT(gpt_tiny(n_head=2, d_model=16)), lambda: GPT(gpt_tiny(n_head=6, d_model=24)),
                  lambda: _llama(6)):
        torch.manual_seed(0)
        try:
            parallelize(build(), config, topo, "cpu")
            messages.append(None)
        except ConfigError as err:
            messages.append((str(err), err.settings))
    return messages


def _llama(heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=heads, num_key_value_heads=2, head_dim=8))


MICRO = 2
CASES_TP2_SP2 = [("gpt", 2, 2, 0), ("gpt", 2, 2, 3), ("llama-sdpa", 2, 2, 0), ("llama-eager", 2, 2, 3),
                 ("sparse-bigbird", 2, 2, 0)]


@pytest.mark.timeout(420)
def test_tp2_sp2_match_one_process():
    results, bad = run_distributed(_train, 4, args=(CASES_TP2_SP2,), timeout=380, preload=HF_RANK_PRELOAD)[0]
    for case in CASES_TP2_SP2:
        family, tp, sp, stage = case
        losses, state = results[case]
        ref_losses, ref_state = _reference(family, 4 // (tp * sp))  # dp replicas
        for every, ref in zip(losses, ref_losses):
            assert max(abs(v - ref) for v in every) < 1e-10, (case, every, ref)  # every rank: the whole-sequence loss
        assert set(ref_state) <= set(state), case  # (ZeRO-3's state adds the non-persistent buffers)
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < 1e-10, (case, worst)
    too_many, gpt_uneven, llama_uneven = bad
    assert too_many == ("sp=2 x tp=2 = 4 exceeds model.n_head=2: every sp x tp rank attends over at least one head",
                        ("sp", "tp")), too_many
    assert gpt_uneven[0].startswith("sp=2 does not divide the 3 heads per tp rank (model.n_head=6 / tp=2"), gpt_uneven
    assert llama_uneven[0].startswith("sp=2 does not divide the 3 heads per tp rank "
                                      "(LlamaForCausalLM.config.num_attention_heads=6 / tp=2"), llama_uneven


def test_tp_sequence_parallel_under_sp_is_a_config_error():
    from lightning_scale.config import ConfigError, from_flat_kwargs
    from lightning_scale.parallelize import check_config

    check_config(from_flat_kwargs(sp=2, tp=2))  # accepted now
    with pytest.raises(ConfigError, match=r"^sp=2 with tensor.sequence_parallel=True: Ulysses already splits"):
        check_config(from_flat_kwargs(sp=2, tp=2, sequence_parallel=True))


CASES_PP2_SP2 = [("gpt", 1, 2, 0, 2), ("gpt", 1, 2, 1, 2, "gpipe"), ("gpt", 1, 2, 3, 2), ("sparse-bigbird", 1, 2, 0, 2),
                 ("gpt", 1, 2, 0, 2, "zero_bubble"), ("llama-sdpa", 1, 2, 0, 2), ("llama-eager", 1, 2, 3, 2),
                 ("gpt2-sdpa", 1, 2, 1, 2)]


def _train_pp(rank: int, world_size: int, cases):
    return {case: _train_one(rank, world_size, *case) for case in cases}


@pytest.mark.timeout(420)
def test_pp2_sp2_match_one_process():
    """Each stage's attention runs over its sp group; micro-batches carry L / sp; the last stage's loss is the
    whole-sequence mean of each micro-batch (the reference: the mean over micro-batches of those)."""
    results = run_distributed(_train_pp, 4, args=(CASES_PP2_SP2,), timeout=380, preload=HF_RANK_PRELOAD)[0]
    for case in CASES_PP2_SP2:
        losses, state = results[case]
        ref_losses, ref_state = _reference(case[0], MICRO)  # dp = 1: the mean over the 2 micro-batches
        for every, ref in zip(losses, ref_losses):
            assert max(abs(v - ref) for v in every) < 1e-10, (case, every, ref)
        assert set(ref_state) <= set(state), case
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < 1e-10, (case, worst)


def test_head_split_checks_name_sp_and_tp():
    """The per-rank head arithmetic of sp x tp without processes (the 4-rank tests check the same through
    parallelize): heads / (tp x sp) per rank, else a ConfigError naming the settings."""
    from lightning_scale.config import ConfigError
    from lightning_scale.sequence_parallel.models import _check_heads

    assert _check_heads(2, 2, 8, "model.n_head") == 2 and _check_heads(4, 1, 8, "model.n_head") == 2
    with pytest.raises(ConfigError, match=r"^sp=4 x tp=4 = 16 exceeds model.n_head=8") as err:
        _check_heads(4, 4, 8, "model.n_head")
    assert err.value.settings == ("sp", "tp")
    with pytest.raises(ConfigError, match=r"^sp=4 does not divide the 6 heads per tp rank \(model.n_head=12 / tp=2"):
        _check_heads(4, 2, 12, "model.n_head")
    with pytest.raises(ConfigError, match=r"^sp=4 does not divide model.n_head=6 \(each sp rank attends over n_head"):
        _check_heads(4, 1, 6, "model.n_head")


CASES_3D_SP = [("gpt", 2, 2, 0, 2), ("gpt", 2, 2, 1, 2, "gpipe"), ("llama-sdpa", 2, 2, 0, 2)]


def _train_3d(rank: int, world_size: int, cases):
    return {case: _train_one(rank, world_size, *case) for case in cases}


@pytest.mark.slow  # 8 gloo ranks on 2 cores
@pytest.mark.timeout(600)
def test_sp2_tp2_pp2_on_8_ranks_match_one_process():
    """sp x tp x pp together (issue 16: "sp composes with tp and pp"): 8 ranks, tp splits the heads, each tp rank's
    heads are split again by Ulysses over sp, two pipeline stages carry (B / M, L / sp) micro-batches. The GPT (1f1b
    at ZeRO 0, gpipe at ZeRO 1) and HF Llama through the pipeline adapter (sdpa, grouped-query kv heads split by tp):
    every rank's loss and the consolidated parameters equal one process on the full sequences within 1e-10."""
    results = run_distributed(_train_3d, 8, args=(CASES_3D_SP,), timeout=560, preload=HF_RANK_PRELOAD)[0]
    for case in CASES_3D_SP:
        losses, state = results[case]
        ref_losses, ref_state = _reference(case[0], MICRO)  # dp = 1: the mean over the micro-batches
        for every, ref in zip(losses, ref_losses):
            assert len(every) == 8 and max(abs(v - ref) for v in every) < 1e-10, (case, every, ref)
        assert set(ref_state) <= set(state), case
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < 1e-10, (case, worst)
