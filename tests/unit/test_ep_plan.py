"""Expert parallelism over data-parallel ranks (``ep=N``): the plan, the grid and what is refused before training.

The numerics (2 ranks, float64, five Hugging Face MoE families, ZeRO 1 / 3, universal checkpoints between ep and dp)
are in tests/dist/test_ep_alltoall.py; a Trainer run in tests/strategies/test_hf_models.py (``mixtral-ep2-zero3``).
"""

from __future__ import annotations

import pytest
import torch.nn as nn

from lightning_scale.config import ConfigError, from_flat_kwargs
from lightning_scale.topology import Topology


def test_the_grid_carries_ep_on_its_tp_axis_and_every_rank_reads_its_own_rows():
    config = from_flat_kwargs(ep=2, stage=3).validate(8)
    assert (config.resolved_dp(8), config.tp_axis, config.partial_grads) == (4, 2, True)
    grid = [Topology.of(config, 8, r) for r in range(8)]
    assert [(t.dp, t.tp, t.ep, t.data_size) for t in grid[:1]] == [(4, 2, 2, 8)]
    assert [t.data_rank for t in grid] == list(range(8))  # a sampler's rank: every rank its own batches
    assert [t.tp_rank for t in grid] == [0, 1] * 4  # ep neighbours exchange the routes
    plain = Topology.of(from_flat_kwargs(tp=2).validate(8), 8, 3)
    assert (plain.ep, plain.data_size, plain.data_rank) == (1, 4, 1)  # tp peers read the same batch
    with pytest.raises(ValueError, match="ep=3"):
        Topology(dp=1, tp=2, ep=3)


@pytest.mark.parametrize("kwargs,message", [
    (dict(ep=2, tp=2), r"^ep=2 with tp=2: expert parallelism over data-parallel ranks does not compose with tensor"),
    (dict(ep=2, tp=2, expert_parallel=True), r"^ep=2 with expert_parallel=True"),
    (dict(ep=1.5), r"^ep=1.5 must be a positive integer"),
])
def test_what_ep_does_not_compose_with_is_named_before_training(kwargs, message):
    from lightning_scale.strategies import Zero3DStrategy

    with pytest.raises(ConfigError, match=message):
        Zero3DStrategy(**kwargs)


def test_ep_composes_with_pipeline_stages():
    config = from_flat_kwargs(ep=2, pp=2, stage=1).validate(8)
    grid = [Topology.of(config, 8, r) for r in range(8)]
    assert (grid[0].dp, grid[0].pp, grid[0].tp, grid[0].data_size) == (2, 2, 2, 4)
    # the two stages of a data-parallel rank read the same rows; the ep ranks of a stage are neighbours
    assert [t.data_rank for t in grid] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [t.pp_rank for t in grid] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_ep_composes_with_ulysses_sequence_parallelism():
    config = from_flat_kwargs(ep=2, sp=2, stage=3).validate(8)
    grid = [Topology.of(config, 8, r) for r in range(8)]
    assert (grid[0].dp, grid[0].sp, grid[0].tp, grid[0].data_size) == (2, 2, 2, 4)
    assert [t.data_rank for t in grid] == [0, 1, 0, 1, 2, 3, 2, 3]  # sp peers read the same rows
    assert [t.sp_rank for t in grid] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_the_world_size_must_hold_ep():
    with pytest.raises(ConfigError, match=r"^tp=1 x ep=4 x pp=1 does not divide the world size 6"):
        from_flat_kwargs(ep=4).validate(6)


def test_the_plan_places_every_experts_module_and_refuses_what_it_cannot():
    pytest.importorskip("transformers")
    from lightning_scale.models import hf_families as F
    from lightning_scale.tensor_parallel.expert_alltoall import expert_data_parallel_plan

    qwen = F.build("qwen2_moe", "eager")
    plan = expert_data_parallel_plan(qwen, 2)
    assert plan == {f"model.layers.{i}.mlp.experts": "expert_data_parallel" for i in range(4)}
    with pytest.raises(ConfigError, match=r"^ep=2: .*no transformers experts module"):
        expert_data_parallel_plan(F.build("llama", "eager"), 2)
    with pytest.raises(ConfigError, match=r"^ep=8: model.layers.0.mlp.experts: 4 experts do not split over ep=8"):
        expert_data_parallel_plan(F.build("mixtral", "eager"), 8)
    # DBRX is a mixture of experts whose experts cannot be placed: said so by name, not "no experts module"
    with pytest.raises(ConfigError, match=r"^ep=2: transformer.blocks.0.ffn.experts: DbrxExperts keeps every expert "
                                          r"in 2-D w1 / v1 / w2 rows.*split every expert over tp instead"):
        expert_data_parallel_plan(F.build("dbrx", "eager"), 2)
    # JetMoE's experts (attention and MLP) are stacked 3-D weights in a module of its own: named, not "no experts"
    with pytest.raises(ConfigError, match=r"^ep=2: model.layers.0.mlp.input_linear \(JetMoeParallelExperts\) holds "
                                          r"stacked 3-D expert weights of a layout expert parallelism does not place"):
        expert_data_parallel_plan(F.build("jetmoe", "eager"), 2)
    with pytest.raises(ConfigError, match=r"^ep=2: .*no transformers experts module"):  # a Mamba conv: not experts
        expert_data_parallel_plan(F.build("bamba", "eager"), 2)

    class Block(nn.Module):  # litgpt's LLaMAMoE layout: a gate and an experts list of MLPs
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 2, bias=False)
            self.experts = nn.ModuleList(nn.Module() for _ in range(2))
            for e in self.experts:
                e.fc_1, e.fc_2, e.proj = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False), nn.Linear(6, 4)

    wrapped = nn.Module()
    wrapped.moe = Block()
    with pytest.raises(ConfigError, match=r"^ep=2: moe: LLaMAMoE|^ep=2: moe: Block is a mixture-of-experts block"):
        expert_data_parallel_plan(wrapped, 2)


def test_a_tensor_parallel_plan_with_ep_is_refused():
    pytest.importorskip("transformers")
    from lightning_scale.models import hf_families as F
    from lightning_scale.parallelize import ParallelModel, apply_ep

    config = from_flat_kwargs(ep=2, plan={"lm_head": "colwise_gather"}).validate(2)
    pm = ParallelModel(F.build("mixtral", "eager"), config, Topology.of(config, 2, 0), "cpu")
    with pytest.raises(ConfigError, match=r"^tensor.plan with ep=2"):
        apply_ep(pm)


def test_the_startup_table_names_the_exchange():
    from lightning_scale.strategies.report import tensor_parallel_row

    row = tensor_parallel_row({"tp": 2, "split": 84, "total": 100, "fraction": 0.84, "replicated": [],
                               "experts_placed": (4, 2, 4), "exchanged": True})
    assert row[0] == "expert parallel" and "placed whole over ep=2 in 4 layers: 2 of 4 per rank" in row[1]
    assert "routes exchanged by all-to-all" in row[1]


def test_onebit_adam_with_ep_is_refused_by_name():
    from lightning_scale.config import check_trainer_flags

    with pytest.raises(ConfigError, match=r"^ep=2: OneBitAdam reduces its own gradients over dp only"):
        check_trainer_flags(from_flat_kwargs(ep=2, stage=1), optimizer="OneBitAdam")
