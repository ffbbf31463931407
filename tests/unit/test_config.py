import pytest

from lightning_scale.config import ConfigError, OffloadConfig, ParallelConfig, ZeroConfig, from_flat_kwargs


def test_flat_kwargs_route_to_sections():
    cfg = from_flat_kwargs(stage=1, bucket_mb=5, tp=2, microbatches=4, schedule="gpipe", offload="optimizer")
    assert cfg.zero.stage == 1 and cfg.zero.bucket_mb == 5
    assert cfg.tp == 2 and cfg.pipeline.microbatches == 4 and cfg.pipeline.schedule == "gpipe"
    assert cfg.offload.optimizer == "cpu"


# Through the Python door (flat keywords) the message names the keyword as typed, never the internal path.
@pytest.mark.parametrize("kwargs,match", [
    (dict(stgae=1), r"^unknown option 'stgae'; known options, close matches first: stage, "),
    (dict(stage=4), r"^stage=4: must be one of 0, 1, 2, 3$"),
    (dict(stage=-1), r"^stage=-1: "),
    (dict(bucket_mb=0), r"^bucket_mb=0 must be > 0"),
    (dict(prefetch_depth=-1), r"^prefetch_depth=-1 must be >= 0"),
    (dict(tp=0), r"^tp=0 must be a positive integer"),
    (dict(schedule="zigzag"), r"^schedule='zigzag': must be one of"),
    (dict(microbatches=0), r"^microbatches=0 must be >= 1"),
    (dict(offload="gpu"), r"^offload='gpu': use 'none', 'optimizer', 'params', 'all'"),
    (dict(stage=0, offload="optimizer"), r"^offload: optimizer offload needs stage >= 1 \(got stage=0"),
    (dict(stage=2, offload="params"), r"^offload: parameter offload needs stage=3 \(got stage=2\)"),
    (dict(sequence_parallel=True), r"^sequence_parallel=True needs tp > 1"),
    (dict(tp=2, overlap_chunks=0), r"^overlap_chunks=0 must be an integer >= 1"),
    (dict(tp=2, overlap_chunks=True), r"^overlap_chunks=True must be an integer >= 1"),
    (dict(overlap_chunks=2), r"^overlap_chunks=2 needs tp > 1"),
    (dict(tp=2, sequence_parallel=True, overlap_chunks=2), r"^overlap_chunks=2 with sequence_parallel=True"),
    (dict(initial_scale=0), r"^initial_scale=0 must be > 0"),
])
def test_bad_options_name_the_setting(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        from_flat_kwargs(**kwargs).validate()
    assert not any(p in str(info.value) for p in ("zero.", "pipeline.", "tensor.", "offload.", "loss_scale."))


def test_parallel_config_users_see_the_internal_paths():
    """Built from the dataclasses themselves, the internal path is what the user typed."""
    with pytest.raises(ConfigError, match=r"^zero.stage=5: must be one of"):
        ParallelConfig(zero=ZeroConfig(stage=5)).validate()
    with pytest.raises(ConfigError, match=r"^offload.params: parameter offload needs zero.stage=3"):
        ParallelConfig(offload=OffloadConfig(params="cpu")).validate()


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
