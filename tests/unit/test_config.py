import pytest

from lightning_scale.config import ConfigError, OffloadConfig, ParallelConfig, ZeroConfig, from_flat_kwargs


def test_flat_kwargs_route_to_sections():
    cfg = from_flat_kwargs(stage=1, bucket_mb=5, tp=2, microbatches=4, schedule="gpipe", offload="optimizer")
    assert cfg.zero.stage == 1 and cfg.zero.bucket_mb == 5
    assert cfg.tp == 2 and cfg.pipeline.microbatches == 4 and cfg.pipeline.schedule == "gpipe"
    assert cfg.offload.optimizer == "cpu"


@pytest.mark.parametrize("kwargs,match", [
    (dict(stgae=1), "unknown option 'stgae'"),
    (dict(stage=4), "zero.stage=4"),
    (dict(stage=-1), "zero.stage=-1"),
    (dict(bucket_mb=0), "zero.bucket_mb=0"),
    (dict(prefetch_depth=-1), "zero.prefetch_depth=-1"),
    (dict(tp=0), "tp=0"),
    (dict(schedule="zigzag"), "pipeline.schedule='zigzag'"),
    (dict(microbatches=0), "pipeline.microbatches=0"),
    (dict(offload="gpu"), "offload='gpu'"),
    (dict(stage=0, offload="optimizer"), "needs zero.stage >= 1"),
    (dict(stage=2, offload="params"), "needs zero.stage=3"),
    (dict(sequence_parallel=True), "sequence_parallel"),
    (dict(initial_scale=0), "loss_scale.initial_scale"),
])
def test_bad_options_name_the_setting(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        from_flat_kwargs(**kwargs).validate()


@pytest.mark.parametrize("world,kwargs,match", [
    (4, dict(tp=3), "tp=3 x pp=1 does not divide the world size 4"),
    (8, dict(dp=3, tp=2), r"dp=3 x tp=2 x pp=1 = 6 does not equal the world size 8"),
])
def test_layout_must_match_world_size(world, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        from_flat_kwargs(**kwargs).validate(world)


def test_resolved_dp():
    cfg = ParallelConfig(tp=2, pp=2).validate(8)
    assert cfg.resolved_dp(8) == 2


def test_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        ZeroConfig(2)  # keyword-only
    cfg = ZeroConfig(stage=1)
    with pytest.raises(Exception):
        cfg.stage = 2  # frozen
    assert OffloadConfig().enabled is False
