"""Pipeline parallelism from the meta device: each rank materializes only its own stage.

``Zero3DStrategy(pp>1)`` runs ``configure_model`` on meta; ``parallelize`` (``apply_pipeline``) cuts the stage, then allocates and
initializes only this rank's layers (the GPT's ``init_module`` contract), so no rank ever holds the whole model.
Checked on pp=2 x dp=2 with a ~34M-parameter GPT (128 MiB): resident memory grows by about the rank's stage, not the model,
and the stage's values equal a plain single-process init, bit for bit (dp replicas agree through the dp broadcast;
the ranks send SHA-256 digests of their parameters, the reference init runs once in the test process).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from lightning_scale.testing import live_rss_bytes, run_distributed


def _cfg():
    from lightning_scale.models import GPTConfig

    return GPTConfig(vocab_size=8192, seq_len=128, n_layer=8, n_head=8, d_model=512)


def _worker(rank: int, world_size: int):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.lit import GPTLightningModule
    from lightning_scale.models.gpt import lm_loss
    from lightning_scale.parallelize import parallelize
    from lightning_scale.topology import Topology

    cfg = _cfg()
    config = from_flat_kwargs(pp=2, microbatches=2, partition="parameters")
    topo = Topology(dp=2, pp=2, rank=rank).build_groups()
    module = GPTLightningModule(cfg)
    torch.manual_seed(0)  # the strategy syncs rank 0's RNG state before configure_model (the GPT's init seed)
    with torch.device("meta"):
        module.configure_model()
    full_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    before = live_rss_bytes()
    glue = parallelize(module, config, topo, "cpu", loss_fn=lm_loss).pipeline  # apply_pipeline: this stage only
    grown = live_rss_bytes() - before
    mine = {n: _digest(p) for n, p in module.named_parameters() if p.numel() > 0}
    stage_bytes = sum(p.numel() * p.element_size() for p in glue.stage.parameters())
    return {"full": full_bytes, "stage": stage_bytes, "grown": grown, "names": sorted(mine), "digests": mine}


def _digest(tensor: torch.Tensor) -> str:
    """The exact bytes of a parameter (bit-for-bit equality without sending 64 MB per stage back)."""
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def _reference_digests():
    """A plain, single-process init of the same model (once, here, not in each of the four ranks)."""
    from lightning_scale.lit import GPTLightningModule
    from lightning_scale.models import GPT

    ref = GPTLightningModule(_cfg())
    torch.manual_seed(0)
    ref.model = GPT(_cfg())
    return {n: _digest(p) for n, p in ref.named_parameters()}


@pytest.mark.timeout(240)
def test_pipeline_stage_is_materialized_alone_from_meta():
    results = run_distributed(_worker, 4, timeout=200)
    expected = _reference_digests()
    # rank = pp_index * dp + dp_index: ranks 0, 1 hold stage 0; ranks 2, 3 stage 1
    assert results[0]["names"] == results[1]["names"] and results[2]["names"] == results[3]["names"]
    assert not set(results[0]["names"]) & set(results[2]["names"])  # no parameter on both stages
    for rank, r in enumerate(results):
        differ = [n for n, d in r["digests"].items() if d != expected[n]]
        assert not differ, (rank, differ)  # equal to a plain init, bit for bit
        assert r["stage"] < 0.6 * r["full"], (rank, r["stage"], r["full"])
        # what the rank allocated is its stage (plus allocator slack), far below the whole model
        assert r["grown"] < r["stage"] + 0.1 * r["full"], (rank, r["grown"] / 2**20, r["stage"] / 2**20,
                                                             r["full"] / 2**20)
