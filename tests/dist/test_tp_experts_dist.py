"""Mixture-of-experts models at tp=2 split their experts (the built-in plan's ``experts`` style) and equal one process.

Mixtral's and Qwen2-MoE's own ``tp_plan`` (transformers 5) covers attention only: at tp=2 the 3-D expert weights,
most of the model, stayed whole on every rank (16% of this Mixtral's parameters split). The built-in plan now cuts
every expert's intermediate width over tp (and Qwen2-MoE's shared expert column / row-wise). One 2-rank launch,
float64, one forward and backward of each family: every rank holds half of each expert weight, the loss and every
consolidated gradient equal one process's. Qwen2-MoE to 1e-12 relative; Mixtral's router keeps its routing weights
in float32 (``softmax(logits.float())``, not cast back), so the gradients reaching the router are float32 partial
sums on each rank, summed by the all-reduce: its router and the layers below it agree to 1e-6 relative (the float32
rounding of the router itself; the unsplit model's tp=2 run differs from one process the same way in the matrix).
A rank that did not all-reduce the routing weights' gradient would be off by half. The training side (ZeRO-1 at
tp=2, a universal checkpoint of the split experts resumed at dp=2) is tests/dist/test_hf_tp_universal.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed

FAMILIES = {"mixtral": 1e-6, "qwen2_moe": 1e-12}


def _batch():
    from lightning_scale.models import hf_families as F

    return F.batch(4, 12, seed=0)


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def worker(rank: int, world_size: int) -> dict:
    import warnings

    import torch.distributed as dist

    from lightning_scale.comm.accounting import CommCounter
    from lightning_scale.models import hf_families as F
    from lightning_scale.tensor_parallel import apply_tensor_parallel, consolidate_state_dict
    from lightning_scale.tensor_parallel.plan import split_summary

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {}
    for family in FAMILIES:
        whole = F.build(family, "eager")
        shapes = {n: tuple(p.shape) for n, p in whole.named_parameters() if ".experts." in n}
        model = apply_tensor_parallel(whole, None, dist.group.WORLD)
        x, y = _batch()
        with CommCounter() as counter:
            loss = _loss(model(input_ids=x).logits, y)
            loss.backward()
        grads = consolidate_state_dict(model, values={n: p.grad for n, p in model.named_parameters()})
        out[family] = dict(loss=loss.item(), grads=grads, full_shapes=shapes,
                           local_shapes={n: tuple(p.shape) for n, p in model.named_parameters() if n in shapes},
                           fraction=split_summary(model, 2)["fraction"],
                           experts_tags=sorted(t for t in counter.by_tag if t.endswith(".experts")))
    return out


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("transformers")
    return run_distributed(worker, 2, (), timeout=300, preload=HF_RANK_PRELOAD)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_at_tp2_splits_the_experts_and_equals_one_process(runs, family):
    from lightning_scale.models import hf_families as F

    ref = F.build(family, "eager")
    x, y = _batch()
    loss = _loss(ref(input_ids=x).logits, y)
    loss.backward()
    tol = FAMILIES[family]
    for rank, run in enumerate(runs):
        r = run[family]
        assert r["full_shapes"], "no expert weights found"
        for name, full in r["full_shapes"].items():  # (E, 2I, H) -> (E, I, H); (E, H, I) -> (E, H, I / 2)
            dim = 1 if name.endswith("gate_up_proj") else 2
            want = tuple(n // 2 if d == dim else n for d, n in enumerate(full))
            assert r["local_shapes"][name] == want, (name, r["local_shapes"][name], want)
        assert r["fraction"] > 0.95, r["fraction"]  # was 0.16 for this Mixtral with its own plan
        assert r["experts_tags"], "no all-reduce tagged by an experts module"
        assert abs(r["loss"] - loss.item()) <= 1e-12 * abs(loss.item()), (rank, r["loss"], loss.item())
        worst = {}
        for name, p in ref.named_parameters():
            g = r["grads"][name]
            worst[name] = ((g - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-300)).item()
        bad = {n: w for n, w in worst.items() if not w <= tol}
        assert not bad, (family, rank, bad)
