import torch

from lightning_scale.zero.flat_buffer import build_buckets


def params(*shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]


def test_buckets_split_groups_reverse_order_and_pad():
    g0 = params((3, 4), (5,), (7,))
    g1 = params((10,))
    buckets = build_buckets([g0, g1], bucket_numel=15, world_size=4)
    # reverse registration order within a group; a bucket never crosses groups
    assert [b.group_index for b in buckets] == [0, 0, 1]
    assert [p.shape for p in buckets[0].params] == [torch.Size([7]), torch.Size([5])]
    assert [p.shape for p in buckets[1].params] == [torch.Size([3, 4])]
    for b in buckets:
        assert b.padded_numel % 4 == 0 and b.padded_numel >= b.numel
        assert b.padded_numel - b.numel < 4
        offsets = [s.offset for s in b.slots]
        assert offsets == sorted(offsets) and b.slots[0].offset == 0
    # every element of every bucket belongs to exactly one rank
    b = buckets[0]
    ranges = [b.shard_range(r) for r in range(4)]
    assert ranges[0][0] == 0 and ranges[-1][1] == b.padded_numel
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(3))


def test_dtype_change_starts_new_bucket_and_big_param_alone():
    g = params((4,)) + params((4,), dtype=torch.float64) + params((100,))
    buckets = build_buckets([g], bucket_numel=10, world_size=1)
    assert [b.numel for b in buckets] == [100, 4, 4]
    assert buckets[1].dtype == torch.float64


def test_small_first_bucket_then_full_buckets():
    g0, g1 = params((3,), (3,), (3,), (3,), (3,)), params((3,), (3,))
    buckets = build_buckets([g0, g1], bucket_numel=9, world_size=1, first_bucket_numel=4)
    # only the very first bucket in backward order is capped (DDP's small first bucket)
    assert [b.numel for b in buckets] == [3, 9, 3, 6]
    assert buckets[0].params[0] is g0[-1]


def test_shard_overlap():
    g = params((6,), (6,))
    b = build_buckets([g], bucket_numel=100, world_size=3)[0]
    assert b.padded_numel == 12 and b.shard_numel == 4
    first, second = b.slots  # reversed: the second parameter first
    assert first.shard_overlap(*b.shard_range(1)) == (4, 6)
    assert second.shard_overlap(*b.shard_range(1)) == (0, 2)
    assert second.shard_overlap(*b.shard_range(0))[1] - second.shard_overlap(*b.shard_range(0))[0] == 0
