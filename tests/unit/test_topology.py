import itertools

import pytest

from lightning_scale import Topology


def factorizations(n):
    for dp, pp in itertools.product(range(1, n + 1), repeat=2):
        if n % (dp * pp) == 0:
            yield dp, pp, n // (dp * pp)


@pytest.mark.parametrize("dp,pp,tp", list(factorizations(8)))
def test_every_factorization_of_8(dp, pp, tp):
    topo = Topology(dp=dp, pp=pp, tp=tp)
    assert topo.world_size == 8
    seen = set()
    for rank in range(8):
        c = topo.coords(rank)
        assert topo.rank_of(pp=c.pp, dp=c.dp, tp=c.tp) == rank
        seen.add((c.pp, c.dp, c.tp))
        # documented order: tp fastest, then dp, then pp
        assert rank == (c.pp * dp + c.dp) * tp + c.tp
    assert len(seen) == 8
    for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
        groups = topo.all_axis_ranks(axis)
        assert len(groups) == 8 // size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(8))  # a partition
        for g in groups:
            coords = [topo.coords(r) for r in g]
            # members differ only along `axis`, ordered by it
            assert [getattr(c, axis) for c in coords] == list(range(size))
            for other in {"dp", "pp", "tp"} - {axis}:
                assert len({getattr(c, other) for c in coords}) == 1
        for rank in range(8):
            assert rank in topo.axis_ranks(axis, rank)


def test_tp_peers_are_neighbours():
    topo = Topology(dp=2, pp=2, tp=2)
    assert topo.axis_ranks("tp", 0) == [0, 1]
    assert topo.axis_ranks("dp", 0) == [0, 2]
    assert topo.axis_ranks("pp", 0) == [0, 4]


@pytest.mark.parametrize("kwargs,match", [
    (dict(dp=0), "dp=0"),
    (dict(tp=-1), "tp=-1"),
    (dict(dp=2, rank=2), "rank=2"),
])
def test_bad_topology(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_unknown_axis_and_index():
    topo = Topology(dp=2, tp=2)
    with pytest.raises(ValueError, match="unknown axis"):
        topo.axis_ranks("xp")
    with pytest.raises(ValueError, match="tp index 2"):
        topo.rank_of(tp=2)


def test_groups_need_distributed():
    with pytest.raises(RuntimeError, match="initialized"):
        Topology(dp=2).build_groups()
