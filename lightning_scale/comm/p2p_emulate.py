"""NCCL's point-to-point semantics, reproduced on gloo so that CPU tests can run the pipeline under them.

``LIGHTNING_SCALE_P2P_EMULATE=nccl`` makes :class:`~lightning_scale.comm.p2p.P2P` post through this module instead of
plain gloo. What it reproduces of ``ProcessGroupNCCL`` (lazy communicator creation, the default when
``init_process_group`` gets no ``device_id``, as under Lightning):

* **tags are ignored**: every message between two ranks of a group is matched in posting order, whatever its kind;
* **one stream per communicator**: ``isend`` / ``irecv`` between two ranks of a group share one 2-rank communicator and
  its stream, so they run one at a time in posting order, and a send may not finish before the peer's matching
  receive runs (NCCL lets ``ncclSend`` block until then): a receive posted early sits in front of every later send to
  that peer on the same communicator;
* **collective creation**: the first operation on a (group, pair) blocks the calling thread until the peer's first
  operation on it (``ncclCommInitRank`` is collective over the pair).

Each (group, pair) gets a thread that runs its operations in order, each one waited before the next (gloo's own send
finishes once the peer has posted the receive). A schedule of posts that would hang on NCCL hangs here too: the wait
on the transfer then fails at the P2P's timeout. Tests only; nothing here runs by default.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

EMULATE_ENV = "LIGHTNING_SCALE_P2P_EMULATE"
_TAG = 0  # NCCL has no tags: one matching order per pair


def emulating_nccl() -> bool:
    return os.environ.get(EMULATE_ENV, "").strip().lower() in ("nccl", "nccl-bound")


def emulating_bound() -> bool:
    """``nccl-bound``: a group bound to a device (``init_process_group(device_id=...)``): NCCL then runs the group's
    point-to-point with every peer on the group's one communicator: one stream per group, not per pair."""
    return os.environ.get(EMULATE_ENV, "").strip().lower() == "nccl-bound"


class _PairStream:
    """The operations of one (group, peer pair), one at a time in posting order."""

    def __init__(self, timeout: Optional[datetime.timedelta]) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._timeout = timeout
        threading.Thread(target=self._loop, name="lightning-scale-p2p-emulated-stream", daemon=True).start()

    def submit(self, pending, call, tensor: torch.Tensor, peer: int, group) -> None:
        self._queue.put((pending, call, tensor, peer, group))

    def _loop(self) -> None:
        while True:
            pending, call, tensor, peer, group = self._queue.get()
            try:
                work = call(tensor, peer, group=group, tag=_TAG)
                if self._timeout is None:
                    work.wait()
                else:
                    work.wait(self._timeout)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the waiter
                pending._error = exc
            pending._work = None  # done (or failed): the waiter only waits for the release below
            pending._posted.release()
            del pending, tensor


_STREAMS: Dict[Tuple[int, str, int, int], _PairStream] = {}
_CONNECTED: set = set()
_LOCK = threading.Lock()


def _connect(group, me: int, peer: int, timeout: Optional[datetime.timedelta]) -> None:
    """Block until ``peer`` has made its first operation on this (group, pair) too (NCCL's communicator creation)."""
    store = dist.distributed_c10d._get_default_store()
    name = f"ls_p2p_emulate/{group.group_name}/{min(me, peer)}-{max(me, peer)}"
    store.set(f"{name}/{me}", "1")
    store.wait([f"{name}/{peer}"], timeout or datetime.timedelta(minutes=30))


def post(pending, call, tensor: torch.Tensor, me: int, peer: int, group, timeout: Optional[datetime.timedelta]) -> None:
    """Queue ``call`` (isend / irecv) of ``tensor`` with ``peer`` on the (group, pair)'s emulated stream; ``pending``
    (a PendingRecv whose ``_posted`` lock is held) is released once the transfer has finished."""
    key = (os.getpid(), group.group_name, min(me, peer), max(me, peer))
    stream_key = (os.getpid(), group.group_name, -1, -1) if emulating_bound() else key
    with _LOCK:
        first = key not in _CONNECTED
        _CONNECTED.add(key)
    if first:
        _connect(group, me, peer, timeout)  # on the caller's thread, as ncclCommInitRank would block it
    with _LOCK:
        stream = _STREAMS.get(stream_key)
        if stream is None:
            stream = _STREAMS[stream_key] = _PairStream(timeout)
    stream.submit(pending, call, tensor, peer, group)
