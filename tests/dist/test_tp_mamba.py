"""Hybrid Mamba-2 + attention models at tp=2 split their Mamba-2 mixers (style ``mamba2``) and equal one process.

Their declared tp plans cover attention only: the mixers (in_proj, conv1d, the per-head A_log / D / dt_bias, the
gated norm, out_proj) stayed whole on every rank (Nemotron-H 35% of the model split at tp=2, Falcon-H1 43%, Bamba
72%). The built-in plan now cuts each mixer's heads and groups over tp (``tensor_parallel/mamba.py``). One 2-rank
launch, float64, one forward and backward of each family built with 2 groups (tp must divide them, as in Megatron),
every bias drawn at random (Bamba with ``mamba_proj_bias=True``: its ``out_proj`` bias is added by rank 0 only) and a
padding mask on one row: every rank holds half of each mixer's ``in_proj`` rows, the loss and every consolidated
gradient equal one process's (1e-10 relative). A rank adding ``out_proj``'s bias too, or a mixer whose output was not
summed over tp, fails here. With one group (most released checkpoints) the mixers stay whole and the startup table
says why: tests/unit/test_tp_hf_coverage.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, random_biases, run_distributed, tp_step, worst_grad_errors

GROUPS = {"bamba": "mamba_n_groups", "nemotron_h": "n_groups", "falcon_h1": "mamba_n_groups",
          "granitemoehybrid": "mamba_n_groups"}
# Bamba's out_proj bias; Nemotron-H with an MLP layer ('-': up / down projections, no gate) beside its Mamba and
# attention layers (its own plan leaves the MLP whole: split by hf_rules.mlps_left_out)
EXTRA = {"bamba": {"mamba_proj_bias": True}, "nemotron_h": {"hybrid_override_pattern": "M-M*"}}
# the share of parameters split at tp=2 (Falcon-H1's and Nemotron-H's small MLP / attention widths leave norms whole)
SPLIT = {"bamba": 0.95, "nemotron_h": 0.85, "falcon_h1": 0.8, "granitemoehybrid": 0.95}
TOL = {"nemotron_h": 1e-6}  # its float32 logits (hf_families.FLOAT32_LOGITS_TOL)


def _build(family: str):
    from lightning_scale.models import hf_families as F

    return random_biases(F.build(family, "eager", overrides={GROUPS[family]: 2, **EXTRA.get(family, {})}))


def _batch():
    from lightning_scale.models import hf_families as F

    x, y = F.batch(4, 12, seed=0)
    mask = torch.ones_like(x)
    mask[0, -3:] = 0
    return x, y, mask


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def worker(rank: int, world_size: int) -> dict:
    import warnings

    import torch.distributed as dist

    from lightning_scale.tensor_parallel import apply_tensor_parallel

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {}
    for family in GROUPS:
        whole = _build(family)
        shapes = {n: tuple(p.shape) for n, p in whole.named_parameters() if n.endswith("in_proj.weight")}
        model = apply_tensor_parallel(whole, None, dist.group.WORLD)
        x, y, mask = _batch()
        out[family] = dict(tp_step(model, _loss, y, shapes.__contains__, input_ids=x, attention_mask=mask),
                           full_shapes=shapes)
    return out


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("transformers")
    return run_distributed(worker, 2, (), timeout=300, preload=HF_RANK_PRELOAD)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", sorted(GROUPS))
def test_mamba2_mixers_at_tp2_equal_one_process(runs, family):
    ref = _build(family)
    x, y, mask = _batch()
    loss = _loss(ref(input_ids=x, attention_mask=mask).logits, y)
    loss.backward()
    tol = TOL.get(family, 1e-10)
    for rank, run in enumerate(runs):
        r = run[family]
        assert r["full_shapes"], "no Mamba-2 mixer found"
        for name, full in r["full_shapes"].items():
            assert r["local_shapes"][name] == (full[0] // 2, full[1]), (name, r["local_shapes"][name], full)
        assert r["fraction"] > SPLIT[family], r["fraction"]
        assert abs(r["loss"] - loss.item()) <= tol * abs(loss.item()), (rank, r["loss"], loss.item())
        bad = worst_grad_errors(ref, r["grads"], tol)
        assert not bad, (family, rank, bad)
