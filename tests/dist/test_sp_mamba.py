"""Hybrid Mamba + attention models under Ulysses sp equal one process (sequence_parallel/mamba.py).

Until 2026-12-07 sp refused every model with recurrent layers by name: a Mamba mixer carries its state along the
whole sequence, which a rank holding one chunk of it cannot run. Now each Mamba mixer gathers the sequence and runs
its 1 / sp of the heads (Mamba-2) or channels (Mamba-1) on all of it, the tp split over the sp group, and the output
is reduce-scattered back; attention layers run Ulysses as before. One 2-rank launch, float64, 3 AdamW steps of each
family from one seed with random biases and a padding mask on one row (labels -100 there): the losses and every
parameter after the steps equal one process's on the whole sequence (1e-10; a group of B / C shared by both ranks
puts the gated norm's float32 statistics in another order: 1e-7 for those). Bamba has one group (its releases too:
the norm's statistics summed over both ranks), Nemotron-H two (one per rank), Falcon-H1 its optional gated norm and
attention beside the mixer in every layer, Jamba Mamba-1 (x_proj's output summed over sp), Qwen3-Next and Qwen 3.5
their gated DeltaNet layers (cut by key-head groups, tensor_parallel/deltanet.py), OLMo hybrid its (a projection per
part), LFM2 its short convolutions (by channels, tensor_parallel/short_conv.py), Mamba (no attention: sp runs only its
mixers, the padding mask gathered for them). ZeRO-3 with activation
checkpointing for two of them (the gathers rerun in the backward). Breaking any piece (the norm's sum, the output's
reduce-scatter, rank 0 alone adding out_proj's bias, x_proj's sum) fails here.

sp=2 x tp=2 on 4 ranks (refused by name until 2026-12-07): tp splits each recurrent layer first, sp then cuts the
heads / channels one tp rank holds over the sp ranks (Bamba's one group over all 4 ranks: the norm's statistics
summed over sp, then over tp), = one process; a layer whose tp-local heads sp does not divide (Qwen 3.5 with 2 key
heads: 1 per tp rank) is a ConfigError naming sp and tp on every rank.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, random_biases, run_distributed

LR = 0.1
STEPS = 3
FAMILIES = {
    "bamba": dict(mamba_proj_bias=True),
    "nemotron_h": dict(n_groups=2, hybrid_override_pattern="M-M*"),
    "falcon_h1": dict(mamba_rms_norm=True),
    "granitemoehybrid": {},
    "jamba": dict(mamba_proj_bias=True),
    # gated DeltaNet (linear attention) + attention: Qwen3-Next (in_proj_qkvz grouped per key head, experts), Qwen 3.5
    # (in_proj_qkv / z / b / a); 2 key heads, 4 value heads
    "qwen3_next": {},
    "qwen3_5": {},
    # LFM2's short gated convolutions (cut by channels), with their biases (out_proj's added by sp rank 0)
    "lfm2": dict(conv_bias=True),
    # OLMo hybrid's gated DeltaNet (a projection per part, o_proj / o_norm); Mamba with no attention at all (its
    # mixers the only thing sp cuts; its padding mask gathered over sp for them), with its projections' biases
    "olmo_hybrid": {},
    "mamba": dict(use_bias=True),
    # Kimi Linear: its delta attention cut by heads over sp (tensor_parallel/kda.py), its latent attention under
    # Ulysses (refused by name before 2026-12-07: a recurrent layer of a kind not cut here)
    "kimi_linear": {},
}
# the float32 gated norm over a group both ranks share; Nemotron-H's float32 logits; Jamba's float32 router / norms
TOL = {"bamba": 1e-7, "granitemoehybrid": 1e-7, "falcon_h1": 1e-7, "nemotron_h": 1e-6, "jamba": 1e-7,
       "qwen3_next": 1e-7, "qwen3_5": 1e-7,
       "olmo_hybrid": 1e-6,  # its A_log stays a float32 parameter in a float64 model (1.2e-7 after 3 steps)
       "mamba": 1e-6,  # Mamba: its selective scan and logits in float32 (hf_families.FLOAT32_LOGITS_TOL)
       "kimi_linear": 1e-5}  # its forget gate's decay in float32 (A_log.float()), its router in float32


# sp x tp: the DeltaNets with 4 key heads (2 per tp rank, 1 per sp x tp rank)
SP_TP = {"bamba": {}, "nemotron_h": {}, "falcon_h1": {}, "jamba": {}, "lfm2": {},
         "qwen3_5": dict(linear_num_key_heads=4, linear_num_value_heads=8)}


def _build(family: str, tp: int = 1):
    from lightning_scale.models import hf_families as F

    extra = SP_TP.get(family, {}) if tp > 1 else {}
    attn = "eager" if family in F.NO_SDPA else "sdpa"  # Mamba: transformers refuses sdpa for it
    return random_biases(F.build(family, attn, overrides={**FAMILIES[family], **extra}))


def _batch(step: int):
    from lightning_scale.models import hf_families as F

    x, y = F.batch(2, 16, seed=step)
    mask = torch.ones_like(x)
    mask[0, -4:] = 0
    y = y.masked_fill(mask == 0, -100)
    return x, y, mask


def _loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def _reference(family: str, tp: int = 1):
    model = _build(family, tp)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y, mask = _batch(step)
        loss = _loss(model(input_ids=x, attention_mask=mask).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_one(rank: int, world_size: int, family: str, stage: int, ac, tp: int = 1) -> tuple:
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize
    from lightning_scale.sequence_parallel import sequence_mean, shard_sequence

    config = from_flat_kwargs(sp=2, tp=tp, stage=stage, activation_checkpointing=ac)
    topo = local_topology(config, world_size, rank)
    model = _build(family, tp)
    pm = parallelize(model, config, topo, "cpu", optimizers=lambda: [torch.optim.SGD(model.parameters(), lr=LR)])
    (engine,) = pm.make_engines()
    losses = []
    for step in range(STEPS):
        x, y, mask = _batch(step)
        x, y, mask = shard_sequence((x, y, mask), topo.sp_rank, topo.sp)
        logits = model(input_ids=x, attention_mask=mask).logits
        total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100,
                                                  reduction="sum")
        loss = sequence_mean(total, (y != -100).sum(), topo.sp_group)
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    if pm.sharded is not None:
        state = pm.sharded.full_state_dict(dtype=None)
        state = pm.consolidate_stage3(state) if tp > 1 else state
    else:
        state = pm.full_state_dict()  # tp: the whole model's names and shapes
    keys = set(model.state_dict(keep_vars=True))
    return losses, {k: v.detach().clone() for k, v in state.items() if k in keys}


def worker(rank: int, world_size: int, cases) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return {case: _train_one(rank, world_size, *case) for case in cases}


CASES = [(f, 0, None) for f in FAMILIES] + [("bamba", 3, "full"), ("jamba", 3, "full")]


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("transformers")
    return run_distributed(worker, 2, (CASES,), timeout=300, preload=HF_RANK_PRELOAD)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-zero{c[1]}" + ("-ac" if c[2] else ""))
def test_hybrid_models_under_sp2_equal_one_process(runs, case):
    _check(runs, case)


def _check(runs, case, tp: int = 1) -> None:
    family = case[0]
    ref_losses, ref_state = _reference(family, tp)
    tol = TOL.get(family, 1e-10)
    for rank, run in enumerate(runs):
        losses, state = run[case]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= tol * max(ref_losses), (rank, losses,
                                                                                              ref_losses)
        assert sorted(state) == sorted(ref_state)
        worst = {k: (state[k] - ref_state[k]).abs().max().item() for k in ref_state}
        bad = {k: w for k, w in worst.items() if not w <= tol}
        assert not bad, (case, rank, sorted(bad.items(), key=lambda t: -t[1])[:5])


def worker_sp_tp(rank: int, world_size: int, cases) -> dict:
    import warnings

    from lightning_scale.config import ConfigError, from_flat_kwargs
    from lightning_scale.models import hf_families as F
    from lightning_scale.parallelize import local_topology, parallelize

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {case: _train_one(rank, world_size, *case, tp=2) for case in cases}
    config = from_flat_kwargs(sp=2, tp=2)  # Qwen 3.5 with its 2 key heads: 1 per tp rank, which sp=2 cannot cut
    model = F.build("qwen3_5", "sdpa")
    try:
        parallelize(model, config, local_topology(config, world_size, rank), "cpu")
        out["refused"] = None
    except ConfigError as err:
        out["refused"] = (str(err), err.settings)
    return out


SP_TP_CASES = [(f, 0, None) for f in SP_TP] + [("bamba", 3, "full")]


@pytest.fixture(scope="module")
def runs_sp_tp():
    pytest.importorskip("transformers")
    return run_distributed(worker_sp_tp, 4, (SP_TP_CASES,), timeout=500, preload=HF_RANK_PRELOAD)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", SP_TP_CASES, ids=lambda c: f"{c[0]}-zero{c[1]}" + ("-ac" if c[2] else ""))
def test_hybrid_models_under_sp2_tp2_equal_one_process(runs_sp_tp, case):
    _check(runs_sp_tp, case, tp=2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sp_tp_refuses_a_layer_whose_tp_local_heads_sp_cannot_cut(runs_sp_tp):
    for run in runs_sp_tp:
        message, settings = run["refused"]
        assert message.startswith("sp=2 with tp > 1: 'model.layers.0.linear_attn'"), message
        assert "does not divide its 1 key heads (what one tp rank holds of it)" in message, message
        assert set(settings) == {"sp", "tp"}
