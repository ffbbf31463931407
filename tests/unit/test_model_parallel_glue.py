"""Pure checks of the tensor / pipeline glue of Zero3DStrategy: Hydra strategy configs, norm masks, early errors."""

from __future__ import annotations

import os

import pytest
import torch

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")


@pytest.mark.parametrize("name,expected", [
    ("tensor", dict(tp=2, pp=1, stage=1)),
    ("pipeline", dict(tp=1, pp=2, stage=1, microbatches=4, schedule="1f1b", partition="parameters")),
    ("3d", dict(tp=2, pp=2, stage=1, microbatches=4)),
])
def test_hydra_strategy_configs_build_the_strategy(name, expected):
    from hydra import compose, initialize_config_dir

    from lightning_scale import Zero3DStrategy
    from lightning_scale.hydra_config import build_strategy, register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"strategy={name}"])
    strategy = build_strategy(cfg.strategy)
    assert isinstance(strategy, Zero3DStrategy)
    c = strategy.config
    got = dict(tp=c.tp, pp=c.pp, stage=c.zero.stage, microbatches=c.pipeline.microbatches,
               schedule=c.pipeline.schedule, partition=c.pipeline.partition)
    assert {k: got[k] for k in expected} == expected
    assert c.tensor.plan is None


def test_hydra_tensor_plan_override_reaches_the_config():
    from hydra import compose, initialize_config_dir

    from lightning_scale.hydra_config import build_strategy, register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["strategy=tensor", "strategy.plan={lm_head: colwise_gather}"])
    assert build_strategy(cfg.strategy).config.tensor.plan == {"lm_head": "colwise_gather"}


def test_norm_mask_counts_replicated_on_tp_rank_zero_and_skips_excluded():
    from lightning_scale.tensor_parallel.sharding import make_spec, mark_sharded, tp_replicated
    from lightning_scale.zero.flat_buffer import build_buckets
    from lightning_scale.zero.model_parallel import norm_mask as _norm_mask

    def norm_mask(bucket, shard, tp_rank, exclude_ids=frozenset()):  # the one cross-axis module, tp's predicate
        return _norm_mask(bucket, shard, tp_rank, replicated=tp_replicated, exclude_ids=exclude_ids)

    sharded, replicated, tied = (torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(3)),
                                 torch.nn.Parameter(torch.zeros(2)))
    mark_sharded(sharded, make_spec(0, 8, 2))
    mark_sharded(tied, make_spec(0, 4, 2))
    (bucket,) = build_buckets([[tied, sharded, replicated]], 100, world_size=1)  # reversed: replicated first
    assert [s.offset for s in bucket.slots] == [0, 3, 11] and bucket.padded_numel == 13
    whole = slice(0, 13)
    assert norm_mask(bucket, whole, tp_rank=0) is None
    assert norm_mask(bucket, whole, tp_rank=1).tolist() == [False] * 3 + [True] * 10
    excluded = norm_mask(bucket, whole, tp_rank=0, exclude_ids=frozenset({id(tied)}))
    assert excluded.tolist() == [True] * 11 + [False] * 2


def test_zero3_composes_with_tp_or_pp_but_not_both_nor_zero_bubble():
    from lightning_scale.config import ConfigError, from_flat_kwargs
    from lightning_scale.parallelize import check_config

    with pytest.raises(ConfigError, match="zero.stage=3 with pp=2 and tp=2"):
        check_config(from_flat_kwargs(stage=3, tp=2, pp=2))
    with pytest.raises(ConfigError, match="pipeline.schedule='zero_bubble'"):
        check_config(from_flat_kwargs(stage=3, pp=2, schedule="zero_bubble"))
    check_config(from_flat_kwargs(stage=3, tp=2))  # ZeRO-3 x tp
    check_config(from_flat_kwargs(stage=3, pp=2))  # ZeRO-3 x pp
    check_config(from_flat_kwargs(stage=2, tp=2, pp=2))


def test_pipeline_contract_errors():
    """A module with no layer sequence, a batch that is not (inputs, targets): ConfigError naming the fix."""
    import torch.nn as nn

    from lightning_scale.config import ConfigError
    from lightning_scale.pipeline import pipeline_layers
    from lightning_scale.strategies.pipeline_glue import split_batch

    with pytest.raises(ConfigError, match="exposes no layer sequence"):
        pipeline_layers(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"\(inputs, targets\)"):
        split_batch({"x": torch.zeros(2)})
    _, y = split_batch((torch.zeros(2), torch.ones(2)))
    assert y.sum() == 2
