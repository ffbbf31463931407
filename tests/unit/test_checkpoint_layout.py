"""The piece model of the layout-free checkpoint format (lightning_scale.checkpoint.layout).

flat range -> rectangles is checked exhaustively on small shapes against a reference mask (every start < end):
the chunks cover exactly the range, do not overlap, are contiguous in flat order at the offsets they report, and
number at most 2 * (ndim - 1) + 1. The tp composition and the vocabulary padding are checked against slicing the
global tensor directly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_scale.checkpoint.layout import (
    Chunk,
    Piece,
    TPSlice,
    chunks_mask,
    flat_piece,
    flat_range_to_chunks,
    tensor_piece,
)

SHAPES = [(), (1,), (7,), (3, 4), (1, 5), (4, 1), (2, 3, 4), (3, 1, 2), (2, 2, 2, 3), (1, 3, 1, 2), (3, 3, 4)]


def _region(t: torch.Tensor, c: Chunk) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_flat_range_to_chunks_exhaustive(shape):
    n = math.prod(shape)
    bound = 2 * max(len(shape) - 1, 0) + 1
    counts = []
    for start, end in itertools.combinations(range(n + 1), 2):
        out = flat_range_to_chunks(shape, start, end)
        ref = torch.zeros(n, dtype=torch.bool)
        ref[start:end] = True
        ref = ref.view(shape)
        total = torch.zeros(shape, dtype=torch.int64)
        flat_index = torch.arange(n).view(shape)
        pos = 0
        for chunk, offset in out:
            total += chunks_mask(shape, [chunk]).long()
            assert offset == pos
            idx = _region(flat_index, chunk).reshape(-1)  # row-major flat positions of the chunk's elements
            assert torch.equal(idx, torch.arange(start + offset, start + offset + chunk.numel)), (shape, start, end)
            pos += chunk.numel
        assert torch.equal(total, ref.long()), (shape, start, end, out)  # exact cover, no overlap
        assert len(out) <= bound, (shape, start, end, out)
        counts.append(len(out))
    if len(shape) >= 1 and all(s >= 3 for s in shape[:-1]) and shape[-1] >= 2:
        assert max(counts) == bound  # the bound is tight: head and tail at every level plus a middle block


def test_flat_range_edges():
    assert flat_range_to_chunks((3, 4), 5, 5) == []
    assert flat_range_to_chunks((3, 4), 0, 12) == [(Chunk((0, 0), (3, 4)), 0)]
    with pytest.raises(ValueError, match=r"outside a tensor of shape \(3, 4\)"):
        flat_range_to_chunks((3, 4), 2, 13)


def test_flat_piece_views_hold_the_chunks():
    g = torch.arange(60.0).view(5, 12)
    flat = g.reshape(-1).clone()
    pieces = [flat_piece("model/w", flat[a:b], (5, 12), a) for a, b in ((0, 17), (17, 41), (41, 60))]
    for p in pieces:
        for c, t in zip(p.chunks, p.tensors):
            assert torch.equal(t, _region(g, c))
            assert t.data_ptr() >= flat.data_ptr() and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert sum(p.numel for p in pieces) == 60
    pieces[1].tensors[0].fill_(-1)  # a view: writes land in the flat shard (what a load does)
    assert (flat[17:17 + pieces[1].chunks[0].numel] == -1).all()


@pytest.mark.parametrize("dim", [0, 1])
def test_tensor_parallel_composition(dim):
    torch.manual_seed(0)
    g = torch.randn(6, 8)
    tp = 2
    size = g.shape[dim] // tp
    covered = torch.zeros(g.shape, dtype=torch.int64)
    for r in range(tp):
        local = g.narrow(dim, r * size, size).contiguous()
        flat = local.reshape(-1)
        # ZeRO over dp=3 inside each tp rank: the flat range is in the *local slice's* row-major order
        bounds = [0, 5, 11, flat.numel()]
        for a, b in zip(bounds, bounds[1:]):
            p = flat_piece("model/w", flat[a:b], local.shape, a, tp=TPSlice(dim, r * size), global_shape=g.shape)
            assert p.global_shape == (6, 8)
            for c, t in zip(p.chunks, p.tensors):
                assert torch.equal(t, _region(g, c)), (dim, r, a, b, c)
                covered += chunks_mask(g.shape, [c]).long()
        whole = tensor_piece("model/w", local, tp=TPSlice(dim, r * size), global_shape=g.shape)
        assert torch.equal(whole.tensors[0], _region(g, whole.chunks[0]))
    assert (covered == 1).all()


def test_vocab_padding_dropped_on_save_and_zeroed_on_load():
    vocab, padded, d = 10, 12, 3  # tp=2: each rank holds 6 rows; rank 1's last two are padding
    torch.manual_seed(0)
    true = torch.randn(vocab, d)
    full = torch.cat([true, torch.full((padded - vocab, d), 7.0)])
    covered = torch.zeros(vocab, d, dtype=torch.int64)
    for r in range(2):
        local = full[r * 6:(r + 1) * 6].clone()
        flat = local.reshape(-1)
        for a, b in ((0, 8), (8, 18)):  # dp=2 flat shards of the tp slice
            p = flat_piece("model/emb", flat[a:b], local.shape, a, tp=TPSlice(0, r * 6),
                           global_shape=(padded, d), true_shape=(vocab, d))
            assert p.global_shape == (vocab, d)
            for c, t in zip(p.chunks, p.tensors):
                assert c.offsets[0] + c.sizes[0] <= vocab
                assert torch.equal(t, _region(true, c))
                covered += chunks_mask((vocab, d), [c]).long()
            assert sum(t.numel() for t in p.padding) == sum(
                1 for i in range(a, b) if r * 6 + i // d >= vocab)  # exactly the padded elements of the range
            p.zero_padding_()
        assert (local[vocab - r * 6:] == 0).all() if r == 1 else True
        if r == 1:
            assert (flat.view(6, d)[4:] == 0).all()  # padding rows zeroed in place in the flat shard
    assert (covered == 1).all()
    whole = tensor_piece("model/emb", full[6:].clone(), tp=TPSlice(0, 6), global_shape=(padded, d),
                         true_shape=(vocab, d))
    assert whole.chunks == [Chunk((6, 0), (4, 3))] and whole.padding[0].shape == (2, 3)


def test_piece_rejects_inconsistent_chunks():
    with pytest.raises(ValueError, match="outside the global shape"):
        Piece("model/w", (4, 4), torch.float32, [Chunk((3, 0), (2, 4))], [torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="held by a tensor of shape"):
        Piece("model/w", (4, 4), torch.float32, [Chunk((0, 0), (2, 4))], [torch.zeros(4, 2)])
    with pytest.raises(ValueError, match="needs the \\(padded\\) global shape"):
        tensor_piece("model/w", torch.zeros(2, 4), tp=TPSlice(0, 2))
