"""Hybrid Mamba-2 + attention models under tp split their Mamba-2 mixers (style ``mamba2``) and equal one process.

Their declared tp plans cover attention only: the mixers (in_proj, conv1d, the per-head A_log / D / dt_bias, the
gated norm, out_proj) stayed whole on every rank (Nemotron-H 35% of the model split at tp=2, Falcon-H1 43%, Bamba
72%). The built-in plan cuts each mixer's heads over tp (``tensor_parallel/mamba.py``): whole groups per rank when tp
divides them (Megatron's case), else each rank's group's B / C rows replicated over the ranks sharing it, with their
gradients and the gated norm's statistics summed over those ranks (the released Bamba, Falcon-H1 and Granite 4
hybrids have one group). Float64, one forward and backward of each family, every bias drawn at random (Bamba with
``mamba_proj_bias=True``: its ``out_proj`` bias is added by rank 0 only) and a padding mask on one row: the loss and
every consolidated gradient equal one process's (1e-10 relative). One 2-rank launch with 2 groups and with 1 group
(tp > G: one group over both ranks), one 4-rank launch with 2 groups (two ranks per group: the per-group sums). A
rank adding ``out_proj``'s bias too, a mixer whose output was not summed over tp, B / C gradients not summed over
their holders or a norm over its own channels only (6e-3 off with one group) fails here.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, random_biases, run_distributed, tp_step, worst_grad_errors

GROUPS = {"bamba": "mamba_n_groups", "nemotron_h": "n_groups", "falcon_h1": "mamba_n_groups",
          "granitemoehybrid": "mamba_n_groups"}
# no groups: Mamba-1 (style mamba1) Jamba, with in_proj / out_proj biases (mamba_proj_bias) beside conv1d's and
# dt_proj's; gated DeltaNet layers (style gated_deltanet: Qwen3-Next, Qwen 3.5; their declared plans gathered the
# projections and ran every head on every rank); LFM2's short convolutions (style short_conv) with their biases
MAMBA1 = {"jamba": {"mamba_proj_bias": True}, "qwen3_next": {}, "qwen3_5": {}, "lfm2": {"conv_bias": True},
          # OLMo hybrid's gated DeltaNet (a projection per part, o_proj / o_norm); Kimi Linear's delta attention (style
          # kimi_delta: its low-rank gates' first halves and o_norm whole, their gradients summed over tp) beside its
          # latent attention (DeepSeek-V3's plan, hf_rules.mla_left_out). Both whole on every rank before 2026-12-07
          "olmo_hybrid": {}, "kimi_linear": {}}
# families whose recurrent layers take the hidden states through q_proj (their attention layers' too: cut by heads)
Q_PROJ = ("olmo_hybrid", "kimi_linear")
# Bamba's out_proj bias; Nemotron-H with an MLP layer ('-': up / down projections, no gate) beside its Mamba and
# attention layers (its own plan leaves the MLP whole: split by hf_rules.mlps_left_out)
EXTRA = {"bamba": {"mamba_proj_bias": True}, "nemotron_h": {"hybrid_override_pattern": "M-M*"}}
# Falcon-H1 with its optional gated norm (off by default), in both orders
VARIANTS = {"falcon_h1_norm": ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False}),
            "falcon_h1_norm_first": ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": True})}
# the share of parameters split at tp=2 (Falcon-H1's and Nemotron-H's small MLP / attention widths leave norms whole)
SPLIT = {"bamba": 0.95, "nemotron_h": 0.85, "falcon_h1": 0.8, "granitemoehybrid": 0.95, "lfm2": 0.9, "kimi_linear": 0.9}
# Nemotron-H's float32 logits (hf_families.FLOAT32_LOGITS_TOL); Jamba's float32 router and dt / B / C norms, which
# read x_proj's output summed over ranks in another order; the DeltaNets' float32 internals
TOL = {"nemotron_h": 1e-6, "jamba": 2e-6, "qwen3_next": 2e-6, "qwen3_5": 2e-6, "olmo_hybrid": 2e-6,
       # Kimi Linear's forget gate computes its decay in float32 (A_log.float()): A_log's gradient, a float32 sum over
       # every position and channel of the rank's heads, 5.4e-6 relative off one process's (f_a_proj's gradient not
       # summed over tp: 0.18)
       "kimi_linear": 1e-5}
# a group over several ranks: the gated norm computes in float32 (transformers casts), its sum of squares now added
# in another order than one process's (8.4e-6 on the last attention layer's k_proj: exactly what one process gets
# summing it in the same two halves)
SHARED_GROUP_TOL = 2e-5


IN_PROJ = ("in_proj.weight", "in_proj_qkvz.weight", "in_proj_qkv.weight")  # the rows tp cuts in each layout


def _build(case: str, groups: int):
    from lightning_scale.models import hf_families as F

    family, extra = VARIANTS.get(case, (case, {}))
    if family in MAMBA1:
        return random_biases(F.build(family, "eager", overrides=MAMBA1[family]))
    overrides = {GROUPS[family]: groups, **EXTRA.get(family, {}), **extra}
    return random_biases(F.build(family, "eager", overrides=overrides))


def _batch():
    from lightning_scale.models import hf_families as F

    x, y = F.batch(4, 12, seed=0)
    mask = torch.ones_like(x)
    mask[0, -3:] = 0
    return x, y, mask


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def worker(rank: int, world_size: int, cases) -> dict:
    import warnings

    import torch.distributed as dist

    from lightning_scale.tensor_parallel import apply_tensor_parallel

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {}
    for family, groups in cases:
        whole = _build(family, groups)
        rows = IN_PROJ + (("q_proj.weight",) if family in Q_PROJ else ())
        shapes = {n: tuple(p.shape) for n, p in whole.named_parameters() if n.endswith(rows)}
        model = apply_tensor_parallel(whole, None, dist.group.WORLD)
        x, y, mask = _batch()
        out[family, groups] = dict(tp_step(model, _loss, y, shapes.__contains__, input_ids=x, attention_mask=mask),
                                   full_shapes=shapes)
    return out


TP2 = [(family, groups) for groups in (2, 1) for family in sorted(GROUPS)] + [("falcon_h1_norm", 1)] + [
    (family, 0) for family in MAMBA1]
TP4 = [("bamba", 2), ("nemotron_h", 1), ("falcon_h1_norm_first", 2), ("jamba", 0)]


@pytest.fixture(scope="module")
def runs_tp2():
    pytest.importorskip("transformers")
    return run_distributed(worker, 2, (TP2,), timeout=300, preload=HF_RANK_PRELOAD)


@pytest.fixture(scope="module")
def runs_tp4():
    pytest.importorskip("transformers")
    return run_distributed(worker, 4, (TP4,), timeout=300, preload=HF_RANK_PRELOAD)


def _local_rows(full_rows: int, family: str, groups: int, tp: int) -> int:
    """in_proj rows on one rank: z, x and dt cut over tp; B and C whole groups (G >= tp) or one group (G < tp);
    Mamba-1: [x | z] cut over tp."""
    if family in MAMBA1:
        return full_rows // tp
    ref = _build(family, groups)
    mixer = next(m for m in ref.modules() if hasattr(m, "in_proj") and hasattr(m, "A_log"))
    gn = mixer.n_groups * mixer.ssm_state_size
    bc = 2 * (gn // tp if groups >= tp else mixer.ssm_state_size)
    assert (full_rows - 2 * gn) % tp == 0
    return (full_rows - 2 * gn) // tp + bc


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family,groups", TP2)
def test_mamba2_mixers_at_tp2_equal_one_process(runs_tp2, family, groups):
    _check(runs_tp2, family, groups, 2)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family,groups", TP4)
def test_mamba2_mixers_at_tp4_equal_one_process(runs_tp4, family, groups):
    _check(runs_tp4, family, groups, 4)


def _check(runs, family: str, groups: int, tp: int) -> None:
    ref = _build(family, groups)
    x, y, mask = _batch()
    loss = _loss(ref(input_ids=x, attention_mask=mask).logits, y)
    loss.backward()
    tol = max(TOL.get(family, 1e-10), SHARED_GROUP_TOL if 0 < groups < tp else 0)
    for rank, run in enumerate(runs):
        r = run[family, groups]
        assert r["full_shapes"], "no Mamba-2 mixer found"
        for name, full in r["full_shapes"].items():
            rows = _local_rows(full[0], family, groups, tp)
            assert r["local_shapes"][name] == (rows, full[1]), (name, r["local_shapes"][name], full)
        if tp == 2:
            assert r["fraction"] > SPLIT.get(VARIANTS.get(family, (family,))[0], 0.95), r["fraction"]
        assert abs(r["loss"] - loss.item()) <= tol * abs(loss.item()), (rank, r["loss"], loss.item())
        bad = worst_grad_errors(ref, r["grads"], tol)
        assert not bad, (family, rank, bad)
