"""Ulysses sequence parallelism with padding and packed-sequence masks, and more Hugging Face families (issue 16),
float64, 3 AdamW steps through parallelize() on 2 gloo ranks (sp=2).

Each batch is a dict ``{input_ids, labels, attention_mask | position_ids}`` cut per sp rank by ``shard_sequence``:

* ``pad``: row 0 left-padded (5 tokens), row 1 right-padded (6 tokens, i.e. rank 1's slice mostly padding), row 3
  both, labels -100 there; the attention sees the whole sequence's padding mask (gathered over sp). ``padright``: the
  right padding only, for eager attention (a left-padded query sees no key: NaN under eager in one process as well);
* ``packed``: rows of 2-3 sequences packed back to back, ``position_ids`` restarting at each (transformers builds a
  block-diagonal causal mask from them); a boundary inside rank 0's slice and one across the slice boundary;
* ``plain``: neither (the fast path: no gather, sdpa's ``is_causal``).

Families: Llama (sdpa and eager), Qwen2 (a per-layer-type mask dict, q/k/v biases) and Mistral (a sliding window of
5 on every layer, which the mask must apply across the slice boundary), at ZeRO 0 and 3: losses (the mean over every
non-ignored label of the whole sequence) and parameters equal one process on the full sequences within 1e-10.
A prepared 4D mask under sp is a ConfigError naming sp.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed

STEPS, BATCH, SEQ, LR = 3, 4, 16, 3e-3


def _build(family: str):
    from lightning_scale.models import hf_families as F

    name, attn = family.split("-")
    return F.build(name, attn, dtype=torch.float64).train()


def _batch(kind: str, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(1, 96, (BATCH, SEQ), generator=g)
    y = x.clone()
    y[2, 4:7] = -100
    batch = {"input_ids": x, "labels": y}
    if kind.startswith("pad"):
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, SEQ - 6:] = 0  # right padding: most of rank 1's half
        mask[3, SEQ - 2 - step:] = 0
        if kind == "pad":  # left padding (its padded queries see no key: NaN rows under eager, one process too)
            mask[0, :5] = 0
            mask[3, :2 + step] = 0
        y[mask == 0] = -100
        batch["attention_mask"] = mask
    elif kind == "packed":
        pieces = [(5, 11), (9, 7), (3, 6, 7), (16,)]  # row 1: a sequence across the slice boundary (8)
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in pieces])
    return batch


def _reference(family: str, kind: str):
    model = _build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        batch = dict(_batch(kind, step))
        y = batch.pop("labels")
        logits = model(**batch, use_cache=False).logits  # (with a cache transformers ignores packed position_ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1),
                                                 ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_one(rank: int, world_size: int, family: str, kind: str, stage: int):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize
    from lightning_scale.sequence_parallel import shard_sequence

    config = from_flat_kwargs(sp=2, stage=stage)
    topo = local_topology(config, world_size, rank)
    model = _build(family)
    pm = parallelize(model, config, topo, "cpu", optimizers=lambda: [torch.optim.AdamW(model.parameters(), lr=LR)])
    (engine,) = pm.make_engines()
    losses = []
    for step in range(STEPS):
        batch = shard_sequence(_batch(kind, step), topo.sp_rank, topo.sp)
        loss = model(**batch).loss
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(float(loss.detach()))
    state = pm.sharded.full_state_dict(dtype=None) if pm.sharded is not None else model.state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}


def _train(rank: int, world_size: int, cases):
    out = {case: _train_one(rank, world_size, *case) for case in cases}
    return out, _bad(rank, world_size)


def _bad(rank: int, world_size: int):
    from lightning_scale.config import ConfigError, from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(sp=2)
    topo = local_topology(config, world_size, rank)
    model = _build("llama-sdpa")
    parallelize(model, config, topo, "cpu")
    try:
        model(input_ids=torch.ones(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 1, 8, 16, dtype=torch.bool))
    except ConfigError as err:
        return str(err), err.settings
    return None


def _check(results, cases):
    for case in cases:
        losses, state = results[case]
        ref_losses, ref_state = _reference(case[0], case[1])
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10, (case, losses, ref_losses)
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < 1e-10, (case, worst)


CASES_LLAMA = [("llama-sdpa", "pad", 0), ("llama-eager", "padright", 3), ("llama-sdpa", "packed", 3),
               ("llama-eager", "packed", 0)]
CASES_FAMILIES = [("qwen2-sdpa", "plain", 0), ("qwen2-eager", "padright", 3), ("qwen2-sdpa", "packed", 0),
                  ("mistral-sdpa", "plain", 3), ("mistral-eager", "packed", 0), ("mistral-sdpa", "pad", 3)]


@pytest.mark.timeout(240)
def test_llama_padding_and_packed_masks_under_sp2_match_one_process():
    results, bad = run_distributed(_train, 2, args=(CASES_LLAMA,), timeout=200, preload=HF_RANK_PRELOAD)[0]
    _check(results, CASES_LLAMA)
    assert bad is not None and bad[0].startswith("sp=2: a prepared attention mask (4-D) cannot be cut"), bad
    assert bad[1] == ("sp",)


@pytest.mark.timeout(240)
def test_qwen2_mistral_under_sp2_match_one_process():
    results, _ = run_distributed(_train, 2, args=(CASES_FAMILIES,), timeout=200, preload=HF_RANK_PRELOAD)[0]
    _check(results, CASES_FAMILIES)


# ------------------------------------------------------------------ sp x pp: the masks built per pipeline layer
MICRO = 2


def _reference_micro(family: str, kind: str):
    """One process, full sequences: the mean over the micro-batches of each one's mean over its non-ignored
    labels (what a pipeline step of MICRO micro-batches trains)."""
    model = _build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        batch = _batch(kind, step)
        total = 0
        for i in range(MICRO):
            part = {k: v.chunk(MICRO)[i] for k, v in batch.items()}
            y = part.pop("labels")
            logits = model(**part, use_cache=False).logits
            total = total + torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1), ignore_index=-100)
        loss = total / MICRO
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_pp_one(rank: int, world_size: int, family: str, kind: str, stage: int):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models.gpt import lm_loss
    from lightning_scale.parallelize import local_topology, parallelize
    from lightning_scale.sequence_parallel import shard_sequence

    config = from_flat_kwargs(sp=2, pp=2, microbatches=MICRO, stage=stage)
    topo = local_topology(config, world_size, rank)
    model = _build(family)
    pm = parallelize(model, config, topo, "cpu", loss_fn=lm_loss, optimizers=lambda: [torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR)])
    (engine,) = pm.make_engines()
    losses = []
    for step in range(STEPS):
        batch = _batch(kind, step)
        y = batch["labels"]  # the pipeline's loss takes next-token targets: shifted before the cut
        batch["labels"] = torch.cat([y[:, 1:], torch.full_like(y[:, :1], -100)], dim=1)
        batch = shard_sequence(batch, topo.sp_rank, topo.sp)
        x = batch["input_ids"]
        if "attention_mask" in batch:  # the padding rides with the micro-batch (as the Trainer glue stacks it)
            x = torch.stack([x, batch["attention_mask"].to(x.dtype)], 1)
        with engine.no_sync():
            loss = pm.pipeline.runtime.train_step(x, batch["labels"]).to(torch.float64)
        engine.step()
        engine.zero_grad()
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
        torch.distributed.all_gather(every, loss.detach().reshape(1))
        losses.append([float(t) for t in every])
    state = pm.consolidate_stage3(pm.sharded.full_state_dict(dtype=None)) if pm.sharded is not None \
        else pm.full_state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}


def _train_pp(rank: int, world_size: int, cases):
    return {case: _train_pp_one(rank, world_size, *case) for case in cases}


CASES_PP = [("llama-sdpa", "pad", 0), ("llama-eager", "padright", 1), ("mistral-sdpa", "plain", 0),
            ("mistral-eager", "plain", 0), ("mistral-sdpa", "pad", 1), ("qwen2-sdpa", "pad", 1)]


@pytest.mark.timeout(420)
def test_padding_and_sliding_window_masks_under_pp2_sp2_match_one_process():
    """pp=2 x sp=2 (4 ranks): each pipeline layer builds the whole sequence's mask (the padding that rides with
    the micro-batch gathered over sp; Mistral's sliding window of 5 across the slice boundary), where before sp x
    pp refused both. Llama (sdpa left + right padding, eager right padding), Mistral (the sliding window alone under
    sdpa and eager, with padding under sdpa; under eager a padded query whose window holds only padding is NaN in
    one process as well), Qwen2 (its per-layer-type masks, padding): every rank's loss and the
    parameters equal one process on the full sequences within 1e-10."""
    results = run_distributed(_train_pp, 4, args=(CASES_PP,), timeout=380, preload=HF_RANK_PRELOAD)[0]
    for case in CASES_PP:
        losses, state = results[case]
        ref_losses, ref_state = _reference_micro(case[0], case[1])
        for every, ref in zip(losses, ref_losses):
            assert len(every) == 4 and max(abs(v - ref) for v in every) < 1e-10, (case, every, ref)
        assert set(ref_state) <= set(state), case
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < 1e-10, (case, worst)
