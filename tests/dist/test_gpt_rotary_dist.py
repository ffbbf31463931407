"""The project GPT with rotary positions (``GPTConfig(position="rotary")``) through parallelize() on 2 gloo ranks,
float64, 3 AdamW steps (with the tiled MLP, exact, but under tp's sequence parallelism): sp=2 at ZeRO 3 (each rank rotates q and k at the global
positions of its slice before the all-to-all), tp=2 with sequence parallelism (the attention sees the gathered
sequence), pp=2 and dp2 ZeRO-3 + full AC + head-tiled attention: losses and parameters equal one process within 1e-10.
A rank that rotated its slice from position 0 (the positions not shifted) fails the sp case.
"""

from __future__ import annotations

import pytest

from lightning_scale.testing import run_distributed
from test_tiled_mlp_dist import MICRO, _train_one, assert_matches_reference

CASES = [("gpt-rotary", (("sp", 2), ("stage", 3))),
         ("gpt-rotary", (("tp", 2), ("sequence_parallel", True), ("overlap_comm", False), ("stage", 1),
                         ("tiled_mlp", 0))),
         ("gpt-rotary", (("pp", 2), ("microbatches", MICRO), ("stage", 1))),
         ("gpt-rotary", (("stage", 3), ("activation_checkpointing", "full"), ("tiled_attention", 2)))]


def _train(rank: int, world_size: int):
    def no_table(model):
        assert getattr(model, "wpe", None) is None and not any("wpe" in n for n, _ in model.named_parameters())

    return {case: _train_one(rank, world_size, case[0], inspect=no_table, **dict(case[1])) for case in CASES}


@pytest.mark.slow  # four layouts on 2 ranks
@pytest.mark.timeout(240)
def test_rotary_gpt_under_sp_tp_pp_zero3_matches_one_process():
    assert_matches_reference(run_distributed(_train, 2, timeout=200)[0], CASES)
