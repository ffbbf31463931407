"""Head-tiled attention through parallelize() on 2 gloo ranks (issue 16), float64, 3 AdamW steps, with the tiled MLP
and its tiled norms: dp2 at ZeRO 3 + full activation checkpointing (the recompute runs the groups again, ZeRO-3's
reduce-scatter fires from the gradient-ready hooks once), sp=2 at ZeRO 3 (each group of 2 heads through the Ulysses
all-to-alls) and pp=2, and an unchanged HF Llama (GQA) at dp2 ZeRO-3 + full AC and at sp=2 (sdpa at ZeRO-3; eager
at ZeRO-2 + full AC: each group's single key/value head repeated for the all-to-all): losses and parameters equal
one untiled process within 1e-10.
"""

from __future__ import annotations

import pytest

from lightning_scale.testing import run_distributed
from test_tiled_mlp_dist import MICRO, _train_one, assert_matches_reference

CASES = [("gpt", (("stage", 3), ("activation_checkpointing", "full"), ("tiled_attention", 1))),
         ("gpt", (("sp", 2), ("stage", 3), ("tiled_attention", 2))),
         ("gpt", (("pp", 2), ("microbatches", MICRO), ("stage", 1), ("activation_checkpointing", "full"),
                  ("tiled_attention", 3))),
         ("llama-sdpa", (("stage", 3), ("activation_checkpointing", "full"), ("tiled_attention", 1))),
         # HF under Ulysses: each group of 2 query heads has 1 key/value head, repeated to split over sp=2
         ("llama-sdpa", (("sp", 2), ("stage", 3), ("tiled_attention", 2))),
         ("llama-eager", (("sp", 2), ("stage", 2), ("activation_checkpointing", "full"), ("tiled_attention", 1)))]


def _train(rank: int, world_size: int):
    from lightning_scale.tiled_attention import tiled_attentions

    out = {}
    for case in CASES:
        seen = []
        out[case] = _train_one(rank, world_size, case[0], inspect=lambda m: seen.extend(tiled_attentions(m)),
                               **dict(case[1]))
        assert seen, (case, "nothing head-tiled")
    return out


@pytest.mark.slow  # six layouts on 2 ranks
@pytest.mark.timeout(240)
def test_tiled_attention_under_zero3_sp_pp_matches_one_untiled_process():
    assert_matches_reference(run_distributed(_train, 2, timeout=200)[0], CASES)
