"""Rank arithmetic for dp x pp x sp x tp layouts, and the process groups of each axis.

Order (documented contract): ``tp`` varies fastest, then ``sp`` (Ulysses sequence parallelism), then ``dp``,
then ``pp``::

    rank = ((pp_index * dp + dp_index) * sp + sp_index) * tp + tp_index

so tensor-parallel peers are neighbours (same host / NVLink domain), sequence-parallel peers (an all-to-all in
every attention) next, and pipeline stages are the outermost split (the axis that crosses slow links). With
``sp == 1`` this is ``(pp_index * dp + dp_index) * tp + tp_index``. ZeRO shards over dp x sp together (as
DeepSpeed does: every parameter is replicated over sp): ``dp_sp_group``. This module is the only place that does rank
arithmetic and the only caller of ``torch.distributed.new_group``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch.distributed as dist

AXES = ("pp", "dp", "sp", "tp")  # outermost first


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int
    sp: int = 0


@dataclass
class Topology:
    """A dp x pp x sp x tp grid over ``world_size = dp * pp * sp * tp`` ranks.

    The pure methods (``coords``, ``rank_of``, ``axis_ranks``, ``all_axis_ranks``) work without
    processes. ``build_groups()`` creates one process group per axis instance (every rank must
    call it, in the same order, once) and keeps the groups this rank belongs to.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    sp: int = 1
    rank: int = 0
    # 1, or tp: the tp axis carries expert parallelism over data-parallel ranks (ParallelConfig.ep): its ranks read
    # different batches (data_size / data_rank), every parameter but the experts is whole on them
    ep: int = 1
    _groups: Dict[str, object] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: each axis size must be a positive integer")
        if self.ep not in (1, self.tp):
            raise ValueError(f"ep={self.ep!r}: the tp axis carries expert parallelism whole (ep == tp) or not (ep=1)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is outside world_size={self.world_size} (dp*pp*sp*tp)")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.sp * self.tp

    # ----------------------------------------------------------------- pure rank arithmetic
    def coords(self, rank: Optional[int] = None) -> Coords:
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        tp_index = rank % self.tp
        sp_index = (rank // self.tp) % self.sp
        dp_index = (rank // (self.tp * self.sp)) % self.dp
        pp_index = rank // (self.tp * self.sp * self.dp)
        return Coords(pp=pp_index, dp=dp_index, tp=tp_index, sp=sp_index)

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0, sp: int = 0) -> int:
        for name, value in (("pp", pp), ("dp", dp), ("sp", sp), ("tp", tp)):
            if not 0 <= value < getattr(self, name):
                raise ValueError(f"{name} index {value} is outside {name}={getattr(self, name)}")
        return ((pp * self.dp + dp) * self.sp + sp) * self.tp + tp

    def axis_ranks(self, axis: str, rank: Optional[int] = None) -> List[int]:
        """Ranks that share every coordinate with ``rank`` except ``axis`` (ordered by that axis)."""
        self._check_axis(axis)
        c = self.coords(rank)
        out = []
        for i in range(getattr(self, axis)):
            kw = {"pp": c.pp, "dp": c.dp, "sp": c.sp, "tp": c.tp, axis: i}
            out.append(self.rank_of(**kw))
        return out

    def all_axis_ranks(self, axis: str) -> List[List[int]]:
        """Every instance of ``axis``: a partition of all ranks into groups of that axis' size."""
        self._check_axis(axis)
        others = [a for a in AXES if a != axis]
        groups = []
        for values in itertools.product(*(range(getattr(self, a)) for a in others)):
            fixed = dict(zip(others, values))
            groups.append([self.rank_of(**{**fixed, axis: i}) for i in range(getattr(self, axis))])
        return groups

    def all_dp_sp_ranks(self) -> List[List[int]]:
        """The groups ZeRO shards over: ranks sharing pp and tp (dp x sp together, ordered by rank)."""
        return [[self.rank_of(pp=pp, dp=d, sp=s, tp=tp) for d in range(self.dp) for s in range(self.sp)]
                for pp in range(self.pp) for tp in range(self.tp)]

    @property
    def dp_sp_ranks(self) -> List[int]:
        return next(g for g in self.all_dp_sp_ranks() if self.rank in g)

    def axis_index(self, axis: str, rank: Optional[int] = None) -> int:
        self._check_axis(axis)
        return getattr(self.coords(rank), axis)

    @classmethod
    def of(cls, config, world_size: int, rank: int) -> "Topology":
        """The grid of a :class:`~lightning_scale.config.ParallelConfig` on ``world_size`` ranks (no groups yet)."""
        return cls(dp=config.resolved_dp(world_size), pp=config.pp, tp=config.tp_axis, sp=config.sp, rank=rank,
                   ep=config.ep)

    @property
    def dp_rank(self) -> int:
        return self.coords().dp

    @property
    def data_size(self) -> int:
        """How many different batches the grid reads at once: dp, times ep (its ranks are data-parallel too)."""
        return self.dp * self.ep

    @property
    def data_rank(self) -> int:
        """Which of them this rank reads (a sampler's ``rank``): dp-major, then the ep index."""
        c = self.coords()
        return c.dp * self.ep + (c.tp if self.ep > 1 else 0)

    @property
    def pp_rank(self) -> int:
        return self.coords().pp

    @property
    def tp_rank(self) -> int:
        return self.coords().tp

    @property
    def sp_rank(self) -> int:
        return self.coords().sp

    @property
    def dp_ranks(self) -> List[int]:
        return self.axis_ranks("dp")

    @property
    def pp_ranks(self) -> List[int]:
        return self.axis_ranks("pp")

    @property
    def tp_ranks(self) -> List[int]:
        return self.axis_ranks("tp")

    @property
    def sp_ranks(self) -> List[int]:
        return self.axis_ranks("sp")

    @staticmethod
    def _check_axis(axis: str) -> None:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; axes are {AXES}")

    # ----------------------------------------------------------------- process groups
    def build_groups(self, backend: Optional[str] = None) -> "Topology":
        """Create one process group per axis instance. Collective: all ranks call it.

        With pp > 1 over NCCL (any backend but gloo) each pipeline group gets a twin for the messages that go from a
        higher to a lower rank (:func:`lightning_scale.comm.p2p.register_reverse_group`). Axes of size 1 get no group
        of their own (``group(axis)`` returns a 1-rank group only
        when needed); the dp axis of a pure data-parallel layout reuses the world group. With sp > 1 the
        dp x sp group (``dp_sp_group``, what ZeRO shards over) is built too; at sp == 1 it is the dp group.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Topology.build_groups() needs torch.distributed to be initialized")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"dp*pp*sp*tp = {self.dp}*{self.pp}*{self.sp}*{self.tp} = {self.world_size} does not equal the "
                f"world size {dist.get_world_size()}"
            )
        if dist.get_rank() != self.rank:
            raise ValueError(f"Topology.rank={self.rank} but this process is rank {dist.get_rank()}")
        for axis in AXES:
            size = getattr(self, axis)
            if size == self.world_size:
                self._groups[axis] = dist.group.WORLD
                continue
            for ranks in self.all_axis_ranks(axis):
                # new_group is collective over all ranks, even those not in `ranks`.
                group = dist.new_group(ranks, backend=backend)
                if self.rank in ranks:
                    self._groups[axis] = group
        self.build_pp_twin(backend or dist.get_backend(), lambda ranks: dist.new_group(ranks, backend=backend))
        if self.tp > 1:  # the tp group's twin: partial gradients summed inside the backward (zero.reducer)
            for ranks in self.all_axis_ranks("tp"):
                group = dist.new_group(ranks, backend=backend)
                if self.rank in ranks:
                    self._groups["tp_grad"] = group
        if self.sp > 1:
            if self.dp == 1:
                self._groups["dp_sp"] = self._groups["sp"]
            elif self.dp * self.sp == self.world_size:
                self._groups["dp_sp"] = dist.group.WORLD
            else:
                for ranks in self.all_dp_sp_ranks():
                    group = dist.new_group(ranks, backend=backend)
                    if self.rank in ranks:
                        self._groups["dp_sp"] = group
        return self

    def build_pp_twin(self, backend, new_group) -> None:
        """Each pipeline group's twin (same ranks) for the point-to-point messages from higher to lower ranks, when
        ``backend`` needs one (:func:`lightning_scale.comm.p2p.needs_direction_groups`: NCCL, any backend but gloo).
        ``new_group(ranks)``: the collective group maker of the caller (every rank calls it for every pipeline).
        This rank's twin is ``_groups["pp_twin"]`` (named in diagnostics, broken with the others) and is registered
        with :mod:`lightning_scale.comm.p2p` against the pp group. When the default group is bound to a device
        (``init_process_group(device_id=...)``, NCCL: one communicator for all of a group's peers) every connected
        (src, dst) of a pipeline gets a 2-rank group instead (``_groups["pp_<src>_to_<dst>"]``)."""
        from lightning_scale.comm.p2p import (bound_to_device, connected_pairs, needs_direction_groups,
                                              register_pair_groups, register_reverse_group)

        if self.pp == 1 or not needs_direction_groups(backend):
            return
        bound = bound_to_device()
        for ranks in self.all_axis_ranks("pp"):
            if not bound:
                group = new_group(ranks)
                if self.rank in ranks:
                    self._groups["pp_twin"] = group
                    register_reverse_group(self._groups["pp"], group)
                continue
            # a device-bound NCCL group runs its point-to-point with every peer on one communicator: at pp >= 3 the
            # twin would still put a middle stage's receive from the left and send to the right on one stream
            pairs = {}
            for lo, hi in connected_pairs(ranks):
                pairs[(lo, hi)], pairs[(hi, lo)] = new_group([lo, hi]), new_group([lo, hi])
            if self.rank in ranks:
                for (src, dst), group in pairs.items():
                    if self.rank in (src, dst):
                        self._groups[f"pp_{src}_to_{dst}"] = group
                register_pair_groups(self._groups["pp"], {k: g for k, g in pairs.items() if self.rank in k})

    def group(self, axis: str):
        self._check_axis(axis)
        if axis not in self._groups:
            if self.world_size == 1 or getattr(self, axis) == 1 and not self._groups:
                return None
            raise RuntimeError("call Topology.build_groups() before asking for process groups")
        return self._groups[axis]

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def tp_grad_group(self):
        """A twin of the tp group (same ranks) that carries only the gradient sums of the ZeRO reducers, so they never
        interleave with the model's own tp collectives inside the backward; None before build_groups / at tp=1."""
        return self._groups.get("tp_grad")

    @property
    def sp_group(self):
        return self.group("sp")

    @property
    def dp_sp_group(self):
        """The group ZeRO shards parameters, gradients and optimizer state over: dp x sp (the dp group at sp == 1)."""
        if self.sp == 1:
            return self.dp_group
        if "dp_sp" not in self._groups:
            raise RuntimeError("call Topology.build_groups() before asking for process groups")
        return self._groups["dp_sp"]
