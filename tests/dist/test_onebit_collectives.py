"""Compressed all-reduce / reduce-scatter on N gloo ranks against the single-process simulation.

One 4-rank spawn serves N = 2, 3, 4: the smaller N run on sub-groups (ranks [0, 1] and [0, 1, 2]),
which also checks that nothing assumes the world group.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_scale.comm import CommCounter, algorithmic_bytes
from lightning_scale.comm.compressed import (
    compressed_all_reduce, compressed_reduce_scatter, error_buffer_numels, new_error_buffers,
    simulate_compressed_all_reduce, simulate_compressed_reduce_scatter,
)
from lightning_scale.testing import run_distributed

# (numel, segments, dtype): lengths on and off multiples of 8 * N, empty and one-element segments.
CASES = [
    (1, None, torch.float64),
    (13, [2, 0, 11], torch.float64),
    (1001, [1, 500, 7, 493], torch.float64),
    (777, [700, 77], torch.float32),
]
ROUNDS = 2
WORLDS = (2, 3, 4)
BYTES_NUMEL = 50_000  # the communication-ratio case: fp32, 20 segments


def _inputs(world, numel, dtype, round_):
    g = torch.Generator().manual_seed(1000 * round_ + numel)
    return [torch.randn(numel, generator=g, dtype=torch.float64).to(dtype) for _ in range(world)]


def _collectives(rank, world, group):
    results = []
    for numel, segments, dtype in CASES:
        we, se = new_error_buffers(torch.zeros(numel, dtype=dtype), group)
        we_rs, se_rs = new_error_buffers(torch.zeros(numel, dtype=dtype), group)
        we_plain = torch.zeros(numel, dtype=dtype)
        outs = []
        for t in range(ROUNDS):
            x = _inputs(world, numel, dtype, t)[rank]
            outs.append((compressed_all_reduce(x, we, se, group, segments=segments),
                         compressed_reduce_scatter(x, we_rs, se_rs, group, segments=segments),
                         compressed_reduce_scatter(x, we_plain, None, group, segments=segments)))
        results.append((outs, we, se, we_plain))
    segments = [BYTES_NUMEL // 20] * 20
    x = torch.randn(BYTES_NUMEL)
    we, se = new_error_buffers(x, group)
    with CommCounter() as counter:
        compressed_all_reduce(x, we, se, group, segments=segments, tag="onebit")
    return results, dict(counter.by_tag)


def _all_worlds(rank, world):
    out = {}
    for size in WORLDS:
        group = dist.new_group(list(range(size))) if size < world else None  # collective on all ranks
        if rank < size:
            out[size] = _collectives(rank, size, group)
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_all_worlds, max(WORLDS), timeout=150)


@pytest.fixture(params=WORLDS, ids=lambda n: f"N{n}")
def dist_results(request, spawned):
    world = request.param
    return world, [spawned[r][world] for r in range(world)]


def test_all_reduce_equals_simulation_exactly(dist_results):
    world, results = dist_results
    for case, (numel, segments, dtype) in enumerate(CASES):
        n_server = error_buffer_numels(numel, world)[1]
        we = [torch.zeros(numel, dtype=dtype) for _ in range(world)]
        se = [torch.zeros(n_server, dtype=dtype) for _ in range(world)]
        for t in range(ROUNDS):
            sim = simulate_compressed_all_reduce(_inputs(world, numel, dtype, t), we, se, segments=segments)
            for r in range(world):
                assert torch.equal(results[r][0][case][0][t][0], sim[r]), (numel, t, r)
        for r in range(world):  # error buffers too: the next round depends on them
            assert torch.equal(results[r][0][case][1], we[r])
            assert torch.equal(results[r][0][case][2], se[r])


def test_reduce_scatter_equals_simulation_exactly(dist_results):
    world, results = dist_results
    for case, (numel, segments, dtype) in enumerate(CASES):
        n_server = error_buffer_numels(numel, world)[1]
        we = [torch.zeros(numel, dtype=dtype) for _ in range(world)]
        se = [torch.zeros(n_server, dtype=dtype) for _ in range(world)]
        we_plain = [torch.zeros(numel, dtype=dtype) for _ in range(world)]
        for t in range(ROUNDS):
            xs = _inputs(world, numel, dtype, t)
            with_server = simulate_compressed_reduce_scatter(xs, we, se, segments=segments)
            plain = simulate_compressed_reduce_scatter(xs, we_plain, None, segments=segments)
            for r in range(world):
                _, rs, rs_plain = results[r][0][case][0][t]
                assert rs.shape == (n_server,)
                assert torch.equal(rs, with_server[r])
                assert torch.equal(rs_plain, plain[r])
                # With a server error, the shard is exactly this rank's chunk of the all-reduce.
                full = results[r][0][case][0][t][0]
                assert torch.equal(rs[: max(0, min(n_server, numel - r * n_server))],
                                   full[r * n_server:(r + 1) * n_server])
        for r in range(world):
            assert torch.equal(results[r][0][case][3], we_plain[r])


def test_compressed_bytes_are_a_sixteenth_of_fp32(dist_results):
    world, results = dist_results
    for _, by_tag in results:
        moved = by_tag["onebit"]
        assert moved > 0
        assert moved <= algorithmic_bytes("all_reduce", 4 * BYTES_NUMEL, world) / 16
        assert moved <= algorithmic_bytes("all_reduce", 2 * BYTES_NUMEL, world) / 8
        # ...and it is close to the 1/32 the bits alone would give (scales are the rest).
        assert moved <= algorithmic_bytes("all_reduce", 4 * BYTES_NUMEL, world) / 30
