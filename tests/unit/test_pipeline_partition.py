"""Partitioners, GPT layer wrappers and stage building (pure, one process)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.models.gpt import GPT, Block, gpt_tiny, make_batch
from lightning_scale.pipeline import (
    GPTEmbedding, GPTHead, build_stage, describe_partition, gpt_pipeline_layers, partition_layers, pipeline_layers,
)
from lightning_scale.pipeline.partition import balanced_bounds


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: OpenMP threads only contend with the other processes on the machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _linears(sizes):
    return [nn.Linear(n, 1, bias=False) for n in sizes]  # layer k holds sizes[k] parameters


def test_uniform_gives_extra_layers_to_the_first_stages():
    assert partition_layers(_linears([1] * 7), 3, "uniform") == [0, 3, 5, 7]
    assert partition_layers(_linears([1] * 4), 4, "uniform") == [0, 1, 2, 3, 4]


def test_parameters_method_is_optimal_against_brute_force():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = int(torch.randint(2, 9, (1,), generator=gen))
        k = int(torch.randint(1, n + 1, (1,), generator=gen))
        weights = torch.randint(1, 50, (n,), generator=gen).tolist()
        bounds = partition_layers(_linears(weights), k, "parameters")
        assert bounds[0] == 0 and bounds[-1] == n and all(a < b for a, b in zip(bounds, bounds[1:]))
        got = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = min(
            max(sum(weights[a:b]) for a, b in zip((0,) + cuts, cuts + (n,)))
            for cuts in itertools.combinations(range(1, n), k - 1)
        )
        assert got == best, (weights, k, bounds)


def test_parameters_method_accounts_embedding_and_head():
    # a big embedding and head: balancing by parameters gives them stages of their own
    gpt = GPT(gpt_tiny(vocab_size=4096, n_layer=4))
    layers = list(gpt_pipeline_layers(gpt))
    bounds = partition_layers(layers, 3, "parameters")
    assert bounds == [0, 1, 5, 6], describe_partition(layers, bounds)
    assert partition_layers(layers, 3, "uniform") == [0, 2, 4, 6]


def test_compute_method_ignores_embedding_tables_and_balances_the_head():
    """'compute' weighs a layer by the parameters it multiplies by: the embedding lookup weighs nothing, the
    d x vocab head weighs what it holds, so the last stage gets fewer blocks."""
    from lightning_scale.models import gpt_small
    from lightning_scale.pipeline.partition import layer_compute

    gpt = GPT(gpt_small(n_layer=8))  # vocab 8192, d 256: the head = 2.7 blocks
    layers = list(gpt_pipeline_layers(gpt))
    assert layer_compute(layers[0]) == 0  # token + position embedding tables
    assert layer_compute(layers[-1]) > 2 * layer_compute(layers[1])
    assert partition_layers(layers, 2, "compute") == [0, 6, 10], describe_partition(layers, [0, 6, 10])
    assert partition_layers(layers, 2, "parameters") == [0, 5, 10]  # embedding counted like the head
    from lightning_scale.config import PipelineConfig

    PipelineConfig(partition="compute").validate(pp=2)  # accepted by the strategy config too


def test_type_regex_balances_matching_layers_and_keeps_embedding_first_head_last():
    layers = list(gpt_pipeline_layers(GPT(gpt_tiny(n_layer=4))))
    assert partition_layers(layers, 2, "type:block") == [0, 3, 6]  # [emb, b0, b1] [b2, b3, head]
    assert partition_layers(layers, 4, "type:^Block$") == [0, 2, 3, 4, 6]
    assert isinstance(layers[0], GPTEmbedding) and isinstance(layers[-1], GPTHead)


def test_partition_errors_name_the_setting():
    layers = _linears([1, 2, 3])
    with pytest.raises(ConfigError, match="need at least 4 layers"):
        partition_layers(layers, 4, "uniform")
    with pytest.raises(ConfigError, match="matches 0 layers"):
        partition_layers(layers, 2, "type:Block")
    with pytest.raises(ConfigError, match="invalid regular expression"):
        partition_layers(layers, 2, "type:(")
    with pytest.raises(ConfigError, match="pipeline.partition='sizes' is unknown"):
        partition_layers(layers, 2, "sizes")


def test_balanced_bounds_handles_zero_weights():
    assert balanced_bounds([0, 0, 5, 0, 5, 0], 2) in ([0, 3, 6], [0, 4, 6], [0, 2, 6])


def test_gpt_pipeline_layers_compute_the_gpt_and_share_its_parameters():
    gpt = GPT(gpt_tiny(n_layer=3, tie_weights=True)).double()
    x, _ = make_batch(gpt.cfg, 2, seed=0)
    seq = gpt_pipeline_layers(gpt)
    torch.testing.assert_close(seq(x), gpt(x), rtol=0, atol=0)
    assert {id(p) for p in seq.parameters()} == {id(p) for p in gpt.parameters()}
    assert seq[-1].lm_head.weight is seq[0].wte.weight


def test_pipeline_layers_contract():
    gpt = GPT(gpt_tiny())
    assert len(pipeline_layers(gpt)) == gpt.cfg.n_layer + 2
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert pipeline_layers(seq) == list(seq)

    class WithHook(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def pipeline_layers(self):
            return [self.a, self.b]

    m = WithHook()
    assert pipeline_layers(m) == [m.a, m.b]
    with pytest.raises(ConfigError, match="exposes no layer sequence"):
        pipeline_layers(nn.Linear(2, 2))


def test_build_stage_keeps_this_ranks_chunks():
    layers = list(gpt_pipeline_layers(GPT(gpt_tiny(n_layer=6))))  # 8 layers
    stage = build_stage(layers, pp=2, pp_rank=1, virtual_stages=2, partition="uniform")
    assert stage.stage_ids == [1, 3] and stage.num_stages == 4
    assert list(stage.chunk(1)) == layers[2:4] and list(stage.chunk(3)) == layers[6:8]
    assert stage.is_last and not stage.is_first
    assert "stage 3" in stage.summary


def test_build_stage_errors():
    layers = list(gpt_pipeline_layers(GPT(gpt_tiny(n_layer=2))))  # 4 layers
    with pytest.raises(ConfigError, match="pp=5 = 5 stages but the model exposes only 4 layers"):
        build_stage(layers, pp=5, pp_rank=0)
    with pytest.raises(ConfigError, match="pipeline.virtual_stages=3 = 6 stages"):
        build_stage(layers, pp=2, pp_rank=0, virtual_stages=3)
    with pytest.raises(ConfigError, match="pp_rank=2 is outside pp=2"):
        build_stage(layers, pp=2, pp_rank=2)


def test_tied_embedding_and_head_are_found_on_both_holders():
    gpt = GPT(gpt_tiny(n_layer=2, tie_weights=True))
    layers = list(gpt_pipeline_layers(gpt))
    first = build_stage(layers, pp=3, pp_rank=0, partition="uniform")
    middle = build_stage(layers, pp=3, pp_rank=1, partition="uniform")
    last = build_stage(layers, pp=3, pp_rank=2, partition="uniform")
    assert [t.ranks for t in first.tied] == [(0, 2)] == [t.ranks for t in last.tied]
    assert first.tied[0].param is gpt.wte.weight and first.tied[0].name == last.tied[0].name
    assert middle.tied == []
    assert build_stage(layers, pp=1, pp_rank=0).tied == []  # both uses on one rank: nothing to sync
    untied = list(gpt_pipeline_layers(GPT(gpt_tiny(n_layer=2))))
    assert build_stage(untied, pp=2, pp_rank=0).tied == []


def test_block_class_is_the_gpt_block():
    assert type(list(gpt_pipeline_layers(GPT(gpt_tiny())))[1]) is Block
