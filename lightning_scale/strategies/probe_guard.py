"""A failing autotune probe, agreed across ranks without waiting for a timeout (``Zero3DStrategy(autotune=True)``,
lightning_scale/strategies/autotune.py): each probe runs on process groups of its own (:func:`probe_groups`); the
first rank whose probe raises publishes its error on the c10d store and breaks those groups (:class:`ProbeGuard`,
:func:`break_groups`), so no rank waits in a collective; every rank then agrees on that error
(:func:`agreed_error`). The default group, which the search and the Trainer use, is never broken."""

from __future__ import annotations

import datetime
import threading
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_scale.config import ParallelConfig

_BREAK_TAG = 97  # the tag of the receive that breaks a probe group's connections (never sent)


def probe_groups(config: ParallelConfig, world: int, rank: int, timeout_s: float):
    """(a Topology for one probe, this rank's groups of it, the whole-world group of it): every axis on new process
    groups (the world-sized ones too, which the Trainer's topology maps to the default group) with a bounded
    timeout, so a failed probe can break its groups without touching the default group the search agrees on and the
    Trainer trains on. Collective: every rank calls it."""
    from lightning_scale.topology import AXES, Topology

    config.validate(world)
    topo = Topology.of(config, world, rank)
    timeout = datetime.timedelta(seconds=float(timeout_s))
    mine: List[Any] = []

    def make(ranks: Sequence[int]):
        group = dist.new_group(list(ranks), timeout=timeout)  # collective over all ranks, members or not
        if rank in ranks:
            mine.append(group)
            return group
        return None

    for axis in AXES:
        for ranks in topo.all_axis_ranks(axis):
            group = make(ranks)
            if group is not None:
                topo._groups[axis] = group
    if topo.sp > 1:
        for ranks in topo.all_dp_sp_ranks():
            group = make(ranks)
            if group is not None:
                topo._groups["dp_sp"] = group
    if topo.tp > 1:  # the tp group's twin (partial gradients summed inside the backward: sp, ep), as build_groups
        for ranks in topo.all_axis_ranks("tp"):
            group = make(ranks)
            if group is not None:
                topo._groups["tp_grad"] = group
    topo.build_pp_twin(dist.get_backend(), make)  # NCCL: the pipeline's twin group, a probe group like the others
    whole = make(range(world))
    return topo, mine, whole


def break_groups(groups: Sequence[Any], rank: int) -> None:
    """Make every peer blocked on this rank in one of ``groups`` fail now, not at the groups' timeout. gloo: a receive
    that times out closes the connection to that peer, and the peer's pending operations on the group raise
    "Connection closed by peer" (gloo's ``abort()`` leaves the connections open; lightning_scale/comm/p2p.py uses the
    same receive); other backends: ``abort()``. Best effort: the caller records the original error."""
    for group in groups:
        try:
            backend = str(dist.get_backend(group))
            peers = [r for r in dist.get_process_group_ranks(group) if r != rank]
        except Exception:  # noqa: BLE001 - destroyed already
            continue
        if backend != "gloo":
            try:
                group.abort()
            except Exception:  # noqa: BLE001
                pass
            continue
        for peer in peers:
            try:
                dist.irecv(torch.empty(1), src=peer, group=group, tag=_BREAK_TAG).wait(
                    datetime.timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - the timeout is the point
                pass


class ProbeGuard:
    """One probe's failure, agreed without waiting for a timeout. The first rank whose probe raises publishes its
    error on the c10d store (``compare_set``: the first one wins; a peer's later "Connection closed" never replaces
    it) and breaks its probe groups; a thread on every rank polls the store and breaks its own groups as soon as
    another rank's failure shows, so a rank blocked in any collective of the probe (whatever group, whatever
    backend) raises at once. The probe groups are destroyed afterwards; the default group is never broken."""

    def __init__(self, store, key: str, groups: Sequence[Any], rank: int, poll_s: float = 0.05) -> None:
        self.store, self.key, self.groups, self.rank, self.poll_s = store, key, list(groups), rank, poll_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._broken = threading.Lock()
        self._done = False

    def __enter__(self) -> "ProbeGuard":
        if self.store is not None:
            self._thread = threading.Thread(target=self._watch, name="lightning_scale-autotune-probe", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if self.store.check([self.key]):
                    self._break()
                    return
            except Exception:  # noqa: BLE001 - the store is gone: the failing rank's own break still works
                return

    def _break(self) -> None:
        with self._broken:
            if not self._done:
                self._done = True
                break_groups(self.groups, self.rank)

    def fail(self, error: str) -> None:
        """This rank's probe raised ``error``: publish it (if first), then break the groups."""
        if self.store is not None:
            try:
                self.store.compare_set(self.key, "", f"rank {self.rank}: {error}")
            except Exception:  # noqa: BLE001
                pass
        self._break()

    def first_error(self) -> str:
        if self.store is None:
            return ""
        try:
            return self.store.get(self.key).decode() if self.store.check([self.key]) else ""
        except Exception:  # noqa: BLE001
            return ""


def describe(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1][:160] if text else ''}"


def probe_store():
    try:
        from lightning_scale.diagnostics.watchdog import default_store

        return default_store()
    except Exception:  # noqa: BLE001 - no c10d store: only the failing rank's own break
        return None


def agreed_error(local: str, guard: Optional[ProbeGuard]) -> str:
    """The probe's error on every rank: the first one published (the store), else the first rank's in rank order."""
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dist.get_rank(), local))
    first = guard.first_error() if guard is not None else ""
    if first:
        return first
    return next((f"rank {r}: {e}" for r, e in every if e), "")
