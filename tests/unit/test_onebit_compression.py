"""1-bit compression math, packing and layouts, checked in one process (no process group)."""

import math

import pytest
import torch

from lightning_scale.comm.compressed import (
    compression_layout, decode_gathered, error_buffer_numels, server_average, server_compress,
    simulate_compressed_all_reduce, simulate_compressed_reduce_scatter, worker_compress,
)
from lightning_scale.kernels.onebit_pack import pack_signs, packed_length, unpack_signs


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_packing_round_trips_every_length():
    for length in range(0, 8 * 4 * 3 + 11):  # covers every remainder modulo 8 * N for N = 2, 3, 4
        x = _randn(2, length, seed=length)
        packed = pack_signs(x)
        assert packed.shape == (2, packed_length(length))
        assert torch.equal(unpack_signs(packed, length), x >= 0)
        # Bits past the length stay zero, so the byte stream is deterministic.
        if length % 8:
            assert int(packed[:, -1].max()) < (1 << (length % 8))


def test_packing_bit_order_is_lsb_first():
    x = torch.tensor([1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0])
    assert pack_signs(x).tolist() == [0b10000001, 0b00000001]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("numel,segments", [(1, None), (7, [3, 0, 4]), (50, [1, 24, 25]), (97, [40, 57])])
def test_layout_pieces_tile_every_chunk(world, numel, segments):
    layout = compression_layout(numel, world, segments)
    assert layout.padded == world * layout.chunk >= numel > layout.padded - world
    covered = []
    for r, pieces in enumerate(layout.pieces):
        assert layout.chunk_real[r] == sum(e - s for _, s, e in pieces) <= layout.chunk
        for p, s, e in pieces:
            a, b = layout.segment_bounds[p]
            assert a <= r * layout.chunk + s < r * layout.chunk + e <= b
            covered += range(r * layout.chunk + s, r * layout.chunk + e)
    assert covered == list(range(numel))


def _naive_scale(x, mode):
    return x.norm() / math.sqrt(x.numel()) if mode == "l2" else x.abs().mean()


@pytest.mark.parametrize("mode", ["l2", "mean_abs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_worker_error_feedback_and_scales(mode, dtype):
    layout = compression_layout(37, 3, [10, 27])
    x, error = _randn(37, seed=1, dtype=dtype), _randn(37, seed=2, dtype=dtype) * 0.1
    corrected = x + error
    bits, scales = worker_compress(x, error, layout, mode)
    decoded = torch.where(bits.reshape(-1)[:37], 1.0, -1.0).to(dtype)
    decoded[:10] *= scales[0]
    decoded[10:] *= scales[1]
    assert torch.allclose(scales[0], _naive_scale(corrected[:10], mode))
    assert torch.allclose(scales[1], _naive_scale(corrected[10:], mode))
    assert torch.equal(bits.reshape(-1)[:37], corrected >= 0)
    # compressed value + new error = input + old error, to float precision
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    assert torch.allclose(decoded + error, corrected, atol=tol, rtol=0)


def test_server_error_feedback():
    layout = compression_layout(50, 4, [1, 24, 25])
    for r in range(4):
        avg, err = _randn(layout.chunk, seed=r), _randn(layout.chunk, seed=10 + r) * 0.1
        real = sum(e - s for _, s, e in layout.pieces[r])
        avg[real:] = 0  # the padding of the last chunk averages to zero
        err[real:] = 0
        corrected = avg + err
        bits, pieces, decoded = server_compress(avg, err, layout, r, "l2")
        assert torch.allclose(decoded + err, corrected, atol=1e-14, rtol=0)
        assert torch.equal(decoded[real:], torch.zeros(layout.chunk - real, dtype=torch.float64))
        for k, (_, s, e) in enumerate(layout.pieces[r]):
            assert torch.allclose(pieces[k], _naive_scale(corrected[s:e], "l2"))
            assert torch.allclose(decoded[s:e].abs(), pieces[k].expand(e - s))


def test_server_average_is_mean_of_decoded_workers():
    layout = compression_layout(10, 2, [4, 6])
    xs = [_randn(10, seed=s) for s in range(2)]
    errors = [torch.zeros(10, dtype=torch.float64) for _ in xs]
    sent = [worker_compress(x, e, layout, "l2") for x, e in zip(xs, errors)]
    decoded = [x - e for x, e in zip(xs, errors)]  # q_i = x_i + 0 - e_i'
    for r in range(2):
        avg = server_average(torch.stack([b[r] for b, _ in sent]), torch.stack([s for _, s in sent]), layout, r)
        expect = (decoded[0] + decoded[1])[r * 5:(r + 1) * 5] / 2
        assert torch.allclose(avg, expect, atol=1e-14)


def test_all_reduce_of_a_one_bit_vector_is_exact():
    # Identical +-c inputs are already 1-bit codes: nothing is lost, errors stay zero.
    n, world = 29, 3
    x = torch.where(_randn(n, seed=3) > 0, 0.5, -0.5).double()
    we = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    se = [torch.zeros(error_buffer_numels(n, world)[1], dtype=torch.float64) for _ in range(world)]
    out = simulate_compressed_all_reduce([x.clone() for _ in range(world)], we, se)
    for o in out:
        assert torch.allclose(o, x, atol=1e-15)
    assert all(float(e.abs().max()) < 1e-15 for e in we + se)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_error_feedback_telescopes_over_rounds(world):
    """sum_t o_t + mean_i e_i + E = sum_t mean_i x_i: no signal is lost, only delayed."""
    n, segments = 61, [20, 1, 40]
    we = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    se = [torch.zeros(error_buffer_numels(n, world)[1], dtype=torch.float64) for _ in range(world)]
    sent_total = torch.zeros(n, dtype=torch.float64)
    out_total = torch.zeros(n, dtype=torch.float64)
    for t in range(6):
        xs = [_randn(n, seed=100 * t + i) for i in range(world)]
        sent_total += torch.stack(xs).mean(0)
        out_total += simulate_compressed_all_reduce(xs, we, se, segments=segments)[0]
    server = torch.cat(se)[:n]
    assert torch.allclose(out_total + torch.stack(we).mean(0) + server, sent_total, atol=1e-12)
    # ...and a single round is a lossy estimate, so the test above is not vacuous.
    assert float((out_total - sent_total).abs().max()) > 1e-3


def test_reduce_scatter_with_server_error_is_the_all_reduce_chunk():
    n, world = 45, 3
    xs = [_randn(n, seed=i) for i in range(world)]
    errs = lambda: ([torch.zeros(n, dtype=torch.float64) for _ in range(world)],  # noqa: E731
                    [torch.zeros(15, dtype=torch.float64) for _ in range(world)])
    we1, se1 = errs()
    we2, se2 = errs()
    full = simulate_compressed_all_reduce(xs, we1, se1, segments=[5, 40])[0]
    shards = simulate_compressed_reduce_scatter(xs, we2, se2, segments=[5, 40])
    assert torch.equal(torch.cat(shards), full)
    plain = simulate_compressed_reduce_scatter(xs, errs()[0], None, segments=[5, 40])
    assert not torch.equal(torch.cat(plain), full)  # without server recompression the mean stays exact


def test_decode_gathered_matches_each_server_decode():
    n, world = 23, 4
    layout = compression_layout(n, world, [3, 20])
    outs = [server_compress(_randn(layout.chunk, seed=r), torch.zeros(layout.chunk, dtype=torch.float64),
                            layout, r, "mean_abs") for r in range(world)]
    outs[-1][2][n - 3 * layout.chunk:] = 0  # last chunk: real elements only
    full = decode_gathered(torch.stack([b for b, _, _ in outs]), torch.stack([p for _, p, _ in outs]), layout)
    assert torch.equal(full, torch.cat([d for _, _, d in outs])[:n])


def test_bad_input_is_rejected_with_a_named_setting():
    x = torch.zeros(10)
    we, se = torch.zeros(10), torch.zeros(5)
    with pytest.raises(ValueError, match="worker_error"):
        simulate_compressed_all_reduce([x, x], [torch.zeros(9), we], [se, se])
    with pytest.raises(ValueError, match="server_error"):
        simulate_compressed_all_reduce([x, x], [we, we.clone()], [torch.zeros(4), se])
    with pytest.raises(ValueError, match="scale"):
        simulate_compressed_all_reduce([x, x], [we, we.clone()], [se, se.clone()], scale="max")
    with pytest.raises(ValueError, match="segments"):
        simulate_compressed_all_reduce([x, x], [we, we.clone()], [se, se.clone()], segments=[3, 3])
    with pytest.raises(ValueError, match="floating"):
        simulate_compressed_all_reduce([torch.zeros(10, dtype=torch.long)] * 2, [we, we], [se, se])
    with pytest.raises(ValueError, match="numel"):
        compression_layout(0, 2)
    with pytest.raises(ValueError, match="backend"):
        pack_signs(x, backend="cuda")
    with pytest.raises(ValueError, match="length"):
        unpack_signs(torch.zeros(1, 2, dtype=torch.uint8), 17)
