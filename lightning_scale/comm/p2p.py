"""Point-to-point transfers between pipeline stages: activations forward, gradients backward.

Why a class and not bare ``dist.isend``:

* shapes are exchanged once: the first message on a (peer, kind, key) channel is preceded by a
  small header (dtype, rank, sizes); later messages reuse the cached shape, so a steady-state step
  sends exactly one message per tensor. ``key`` is chosen by the caller (the runtime uses the
  sending stage and the micro-batch input shape) so a new batch shape starts a new exchange;
* sends are asynchronous (posted, then waited together by :meth:`wait_sends`), receives are
  posted asynchronously and waited when the data is needed;
* messages of one kind between two ranks are matched in order, which the schedule validator
  guarantees; the kind selects the tag, so activations and gradients never cross;
* every byte is recorded with :func:`lightning_scale.comm.accounting.record`;
* :meth:`abort` makes peers that are blocked on this rank fail at once instead of hanging;
* :meth:`send_detached` / :meth:`recv_tagged`: a fixed-shape message (no header) on a tag of the caller's
  (:func:`stream_tag`) whose send the caller does not wait for. Its handle is also kept in a process-wide
  list until the transfer has completed: under gloo a send whose work object is freed before the peer posts
  its receive never arrives (the peer then blocks), and the sending object may be dropped first;
* under gloo the ``isend`` / ``irecv`` calls themselves are made by one poster thread per process (FIFO, so the
  order of messages on a channel is the order of the calls here): gloo writes a send's bytes into the socket inside
  ``isend`` when the peer's receive is already posted (~0.1-0.3 ms for a 256 KB activation on a loaded 2-core box)
  and ``irecv`` writes its ready notice under the pair's lock, so posting on the caller's thread cost the stage
  that time between two computes. The caller now only allocates, records and enqueues (a few us); the handle
  (:class:`PendingRecv`) waits for the post, then for the transfer. Accounting and the diagnostics trace stay on
  the caller's thread (their records are per thread). NCCL's calls only enqueue a kernel: no thread there.
  ``LIGHTNING_SCALE_P2P_THREAD=0`` (or ``P2P(threaded=False)``) posts on the caller's thread;
* **direction groups** (NCCL and every backend but gloo): NCCL ignores tags, and ``ProcessGroupNCCL`` runs all
  point-to-point operations between two ranks of a group on one communicator and stream, in posting order, where a
  send may wait for the peer's receive. A receive posted early (prefetch) would then sit in front of this rank's
  later sends to that peer, and both ranks could wait on each other. :meth:`Topology.build_groups` therefore gives each
  pipeline group a twin with the same ranks (:func:`register_reverse_group`): messages from a lower to a higher rank go
  on the group, from higher to lower on the twin, so each (communicator, pair) carries one direction and is a FIFO,
  kept in step by the schedule validator's order matching per direction (activations and gradients together). NCCL
  creates a pair's communicator at its first operation, collectively: a P2P with a twin therefore makes the first
  transfer of every pair at construction, pair by pair in one global order. Under
  ``LIGHTNING_SCALE_P2P_EMULATE=nccl`` (tests), gloo behaves as NCCL's point to point (:mod:`.p2p_emulate`). This
  assumes NCCL's per-pair communicators (``init_process_group`` without ``device_id``, as under Lightning); a group
  bound to a device runs all its peers on one communicator, so there each connected (src, dst) gets a 2-rank group of
  its own instead (:func:`register_pair_groups`).
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import threading
from _thread import allocate_lock as _allocate_lock
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_scale.comm import p2p_emulate
from lightning_scale.comm.accounting import record
from lightning_scale.diagnostics import trace as _trace

TAGS = {"act": 11, "grad": 12, "tied": 13, "connect": 14}
_ABORT_TAG = 99
# tags of stream_tag(): above every fixed tag; gloo tags are C ints
_STREAM_TAG_BASE, _STREAMS, _STREAM_SEQS = 1 << 28, 1 << 12, 1 << 16
_MAX_DIMS = 8
THREAD_ENV = "LIGHTNING_SCALE_P2P_THREAD"
DIRECTION_GROUPS_ENV = "LIGHTNING_SCALE_P2P_DIRECTION_GROUPS"  # "0": no twin groups (tests: show the hang they avoid)
# pipeline group -> its twin with the same ranks, for messages from a higher to a lower rank (Topology.build_groups)
_REVERSE: Dict[object, object] = {}
# pipeline group -> {(src, dst): the 2-rank group for src -> dst}, for a process group bound to a device (see below)
_PAIR_GROUPS: Dict[object, Dict[Tuple[int, int], object]] = {}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def needs_direction_groups(backend) -> bool:
    """True when point-to-point transfers over ``backend`` need one group per direction (see the module doc): every
    backend but gloo (whose tags keep kinds apart and whose sends and receives do not queue behind each other), and
    gloo under the NCCL emulation."""
    if os.environ.get(DIRECTION_GROUPS_ENV, "").strip() == "0":
        return False
    return p2p_emulate.emulating_nccl() or str(backend).strip().lower() != "gloo"


def register_reverse_group(group, reverse) -> None:
    """``reverse`` (the same ranks as ``group``) carries ``group``'s point-to-point messages from higher to lower
    ranks."""
    _REVERSE[group] = reverse


def register_pair_groups(group, pairs: Dict[Tuple[int, int], object]) -> None:
    """``pairs[(src, dst)]``: the 2-rank group that carries ``group``'s messages from ``src`` to ``dst`` (instead of
    the twin): what a device-bound NCCL group needs, whose point-to-point shares one communicator for all peers."""
    _PAIR_GROUPS[group] = dict(pairs)


def bound_to_device() -> bool:
    """True when the default group is bound to a device (``init_process_group(device_id=...)``): ProcessGroupNCCL
    then runs a group's point-to-point with every peer on the group's one communicator and stream (also under the
    ``nccl-bound`` emulation)."""
    if p2p_emulate.emulating_bound():
        return True
    try:
        return getattr(dist.group.WORLD, "bound_device_id", None) is not None
    except Exception:  # noqa: BLE001 - no default group
        return False


def connected_pairs(ranks: Sequence[int]) -> List[Tuple[int, int]]:
    """The (lower, higher) global-rank pairs a pipeline exchanges messages between, in one global order: neighbours in
    stage order (first and last stage included: interleaved schedules, tied parameters) and the last stage with every
    rank (the loss hand-out)."""
    n = len(ranks)
    pairs = {tuple(sorted((ranks[k], ranks[(k + 1) % n]))) for k in range(n) if n > 1}
    pairs |= {tuple(sorted((r, ranks[-1]))) for r in ranks[:-1]}
    return sorted(pairs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sendable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached and contiguous, with no torch call where it already is (the runtime's activations and
    gradients are: each call between two computes is one more cold dispatch)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def stream_tag(stream: int, seq: int) -> int:
    """The tag of message ``seq`` of ``stream``: distinct for every (stream mod 4096, seq mod 65536) and from the
    fixed tags (``TAGS``, abort). Both ends compute it, so a receive can only match the message it expects; a
    receive posted for another stream or step never takes a send that was meant for a different one."""
    return _STREAM_TAG_BASE | (stream % _STREAMS) << 16 | (seq % _STREAM_SEQS)


# Detached sends of every P2P of this process, not yet seen complete (pruned at each new one, waited at exit).
_DETACHED: List["PendingRecv"] = []


def wait_detached() -> None:
    """Block until every detached send of this process has been received (before tearing down the process group
    right after a pipeline step: a peer may not have posted its receive yet)."""
    while _DETACHED:
        _DETACHED.pop(0).wait()


@atexit.register
def _wait_detached_at_exit(bound_s: float = 30.0) -> None:
    """At exit, give the peers up to ``bound_s`` in all to receive what is still in flight (not the group's
    timeout: a peer that hangs must not hold this process's exit for 30 minutes)."""
    import time

    deadline = time.monotonic() + bound_s
    while _DETACHED:
        pending = _DETACHED.pop(0)
        try:
            pending._await_post(datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
            if pending._work is not None:
                pending._work.wait(datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - the group may be gone, the peer dead: nothing left to deliver to
            pass


class PendingRecv:
    """A posted receive (or send); :meth:`wait` returns the tensor (filled, for a receive). Waiting twice is free.

    ``posted``: None when ``work`` is the transfer's work object already; else a held lock the poster thread
    releases once it has made the call (``work`` / ``error`` are then filled in; a lock, not an Event: ten times
    cheaper to make)."""

    def __init__(self, tensor: torch.Tensor, work, timeout: Optional[datetime.timedelta], seq: int = 0,
                 posted=None) -> None:
        self.tensor, self._work, self._timeout = tensor, work, timeout
        self._seq = seq  # diagnostics: what the watchdog reports when this rank blocks here
        self._posted, self._error = posted, None
        self._done = False

    def _await_post(self, timeout: Optional[datetime.timedelta]) -> None:
        posted = self._posted
        if posted is not None:
            if not posted.acquire(timeout=-1 if timeout is None else max(0.0, timeout.total_seconds())):
                raise RuntimeError(f"p2p: the poster thread did not post this transfer (NCCL emulated: or did not "
                                   f"finish it) within {timeout}")
            self._posted = None
        if self._error is not None:
            raise self._error

    def wait(self) -> torch.Tensor:
        if not self._done:
            if self._seq:
                _trace.wait_begin(self._seq)
            self._await_post(self._timeout)
            if self._work is not None:
                if self._timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(self._timeout)
            if self._seq:
                _trace.wait_end(self._seq)
            self._work, self._done = None, True
        return self.tensor

    def is_completed(self) -> bool:
        """True once the transfer is done (never blocks)."""
        if self._done:
            return True
        if self._posted is not None and self._posted.locked():
            return False
        return self._error is not None or self._work is None or self._work.is_completed()


class _Poster:
    """The thread that makes this process's gloo ``isend`` / ``irecv`` calls, in submission order."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="lightning-scale-p2p", daemon=True)
        self._thread.start()

    def submit(self, pending: PendingRecv, call, tensor: torch.Tensor, peer: int, group, tag: int) -> None:
        self._queue.put((pending, call, tensor, peer, group, tag))

    def _loop(self) -> None:
        get = self._queue.get
        while True:
            pending, call, tensor, peer, group, tag = get()
            try:
                pending._work = call(tensor, peer, group=group, tag=tag)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the waiter
                pending._error = exc
            pending._posted.release()
            del pending, tensor


_POSTER: Optional[_Poster] = None
_POSTER_LOCK = threading.Lock()


def _poster() -> _Poster:
    global _POSTER
    poster = _POSTER
    if poster is None or poster.pid != os.getpid():  # a forked child has no thread
        with _POSTER_LOCK:
            if _POSTER is None or _POSTER.pid != os.getpid():
                _POSTER = _Poster()
            poster = _POSTER
    return poster


def _reset_poster_in_child() -> None:
    global _POSTER, _POSTER_LOCK
    _POSTER, _POSTER_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_poster_in_child)


def _isend(tensor, peer, *, group, tag):
    return dist.isend(tensor, dst=peer, group=group, tag=tag)


def _irecv(tensor, peer, *, group, tag):
    return dist.irecv(tensor, src=peer, group=group, tag=tag)


def _threaded_default(group, threaded: Optional[bool]) -> bool:
    if threaded is not None:
        return bool(threaded)
    if os.environ.get(THREAD_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        return group is not None and str(dist.get_backend(group)) == "gloo"
    except Exception:  # noqa: BLE001 - no group yet: post on the caller's thread
        return False


class P2P:
    """Asynchronous send/recv over ``group`` (peers named by global rank) with cached shapes.

    ``device``: where the connection transfers of a group with a direction twin live (a stage's parameters' device);
    ``ranks``: the group's global ranks in pipeline-stage order (default: the group's order)."""

    def __init__(self, group, *, timeout: Optional[datetime.timedelta] = None,
                 threaded: Optional[bool] = None, device=None, ranks: Optional[Sequence[int]] = None) -> None:
        self.group = group
        self.timeout = timeout
        self.emulate = p2p_emulate.emulating_nccl()
        # post through the process's poster thread (default: under gloo; see the module doc)
        self.threaded = _threaded_default(group, threaded) and not self.emulate
        self.reverse_group = _REVERSE.get(group)  # messages from a higher to a lower rank (module doc)
        self.pair_groups = _PAIR_GROUPS.get(group)  # or one group per (src, dst): a device-bound NCCL group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._shapes: Dict[Tuple[int, str, Hashable], Tuple[torch.Size, torch.dtype]] = {}
        self._sent_headers: set = set()
        self._sends: List[PendingRecv] = []  # posted sends; each keeps its tensor alive until waited
        # (shape, dtype) -> CPU receive buffers handed back by recycle(): a receive takes one instead of allocating
        # (a torch.empty between two computes costs ~0.1 ms on a loaded CPU box: its code is cold by then)
        self._free: Dict[Tuple[torch.Size, torch.dtype], List[torch.Tensor]] = {}
        self.reused = 0  # receives that filled a recycled buffer (diagnostics, tests)
        if self.reverse_group is not None or self.pair_groups is not None:
            self._connect_pairs(device, ranks)

    def _connect_pairs(self, device, ranks: Optional[List[int]]) -> None:
        """One small transfer each way between every two ranks that a pipeline connects (neighbours in stage order,
        the first and last stage included, and the last stage with every rank: the loss hand-out), pairs in one
        global order, each waited: NCCL creates a pair's communicator (one per direction group) collectively at its
        first transfer, so the first transfers must not depend on the schedule (in it, two ranks can each start on a
        different communicator). Pairs that never talk get no communicator."""
        ranks = list(ranks) if ranks is not None else dist.get_process_group_ranks(self.group)
        if device is None or torch.device(device).type == "meta":  # a stage built on meta: the backend's device
            nccl = "nccl" in str(dist.get_backend(self.group)).lower() and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        one = torch.zeros(1, device=device)
        for i, j in connected_pairs(ranks):
            if self.rank == i:
                self._post_send(one, j, TAGS["connect"], "pp_connect").wait()
                self.recv_tagged(torch.empty_like(one), j, TAGS["connect"], "pp_connect").wait()
            elif self.rank == j:
                self.recv_tagged(torch.empty_like(one), i, TAGS["connect"], "pp_connect").wait()
                self._post_send(one, i, TAGS["connect"], "pp_connect").wait()
        self._sends.clear()

    def _group_of(self, src: int, dst: int):
        """The group a message from global rank ``src`` to ``dst`` travels on: its own 2-rank group on a device-bound
        NCCL group, else the twin when higher -> lower."""
        if self.pair_groups is not None:
            return self.pair_groups[(src, dst)]
        return self.group if self.reverse_group is None or src < dst else self.reverse_group

    # ------------------------------------------------------------------ send / recv
    def send(self, tensor: torch.Tensor, dst: int, kind: str, key: Hashable = None) -> PendingRecv:
        """Post ``tensor`` to global rank ``dst``; the tensor must not be modified until wait_sends().

        Returns the send's handle: waiting on it early is allowed (``wait_sends`` then skips it)."""
        tag = TAGS[kind]
        tensor = _sendable(tensor)
        channel = (dst, kind, key)
        if channel not in self._sent_headers:
            header = self._header(tensor)
            self._post_send(header, dst, tag, "pp_meta")
            self._sent_headers.add(channel)
        return self._post_send(tensor, dst, tag, f"pp_{kind}")

    def recv(self, src: int, kind: str, key: Hashable = None, device=None) -> PendingRecv:
        """Post a receive from global rank ``src``; the first one on a channel blocks for the header."""
        tag = TAGS[kind]
        channel = (src, kind, key)
        if channel not in self._shapes:
            header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
            record("recv", _nbytes(header), 2, "pp_meta")
            seq = _trace.enter(f"recv<-{src}", _nbytes(header), self.group, "pp_meta")
            self._post(_irecv, header, src, tag, seq).wait()
            code, ndim = int(header[0]), int(header[1])
            self._shapes[channel] = (torch.Size(header[2:2 + ndim].tolist()), _DTYPES[code])
        shape, dtype = self._shapes[channel]
        free = self._free.get((shape, dtype)) if device is None or torch.device(device).type == "cpu" else None
        if free:
            buf = free.pop()
            self.reused += 1
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
        record("recv", _nbytes(buf), 2, f"pp_{kind}")
        seq = _trace.enter(f"recv<-{src}", _nbytes(buf), self.group, f"pp_{kind}")
        return self._post(_irecv, buf, src, tag, seq)

    def send_detached(self, tensor: torch.Tensor, dst: int, tag: int, acct: str) -> PendingRecv:
        """Post ``tensor`` (no header: the receiver knows its shape) on ``tag``; the caller need not wait for it.

        The send is waited with this P2P's others (:meth:`wait_sends`) and is also kept alive, process-wide, until
        it completes, so dropping this P2P (or its owner) right after cannot lose it. ``tensor`` must not be
        modified afterwards."""
        _DETACHED[:] = [h for h in _DETACHED if not h.is_completed()]
        pending = self._post_send(tensor.detach().contiguous(), dst, tag, acct)
        _DETACHED.append(pending)
        return pending

    def recv_tagged(self, out: torch.Tensor, src: int, tag: int, acct: str) -> PendingRecv:
        """Post a receive into ``out`` (its shape and dtype are the message's) on ``tag``: :meth:`send_detached`'s peer."""
        record("recv", _nbytes(out), 2, acct)
        seq = _trace.enter(f"recv<-{src}", _nbytes(out), self.group, acct)
        return self._post(_irecv, out, src, tag, seq)

    def recycle(self, tensor: torch.Tensor) -> None:
        """Hand back a buffer a receive returned, once nothing uses it any more (the caller's promise): a later
        receive of the same shape and dtype fills it instead of allocating. CPU only; two per shape are kept, and
        :meth:`release_free` drops them (the runtime does at the end of each step, so between steps the memory is
        what it was without the pool)."""
        if tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.storage_offset() == 0:
            free = self._free.setdefault((tensor.shape, tensor.dtype), [])
            if len(free) < 2:
                free.append(tensor)

    def release_free(self) -> None:
        """Drop the recycled buffers not taken yet."""
        self._free.clear()

    def has_shape(self, src: int, kind: str, key: Hashable = None) -> bool:
        """True when a receive on this channel would not block for a header."""
        return (src, kind, key) in self._shapes

    def exchange(self, tensor: torch.Tensor, peer: int, kind: str = "tied") -> torch.Tensor:
        """Send ``tensor`` to ``peer`` and return the same-shaped tensor ``peer`` sends back."""
        out = torch.empty_like(tensor)
        record("recv", _nbytes(out), 2, f"pp_{kind}")
        seq = _trace.enter(f"recv<-{peer}", _nbytes(out), self.group, f"pp_{kind}")
        pending = self._post(_irecv, out, peer, TAGS[kind], seq)
        self._post_send(tensor.detach().contiguous(), peer, TAGS[kind], f"pp_{kind}")
        pending.wait()
        self.wait_sends()
        return out

    def wait_sends(self) -> None:
        """Block until every posted send has completed (the peers have received them)."""
        sends, self._sends = self._sends, []
        for pending in sends:
            pending.wait()

    def reset(self) -> None:
        """Forget cached shapes (both sides must reset together, e.g. when the batch shape changes)."""
        self._shapes.clear()
        self._sent_headers.clear()
        self._free.clear()

    # ------------------------------------------------------------------ failure
    def abort(self, peers: Iterable[int]) -> None:
        """Make ranks blocked on this one fail now rather than at their timeout.

        gloo keeps a dead rank's connections open until its process exits, and its
        ``ProcessGroup.abort()`` does not close them; but a receive that times out closes the
        connection, and the peer's pending operations then raise "Connection closed by peer".
        Other backends (NCCL) implement ``abort()``. Best effort: errors here are swallowed, the
        caller re-raises the original exception.
        """
        self._sends.clear()
        try:
            backend = str(dist.get_backend(self.group))
        except Exception:  # noqa: BLE001 - group already gone
            return
        groups = [g for g in (self.group, self.reverse_group, *(self.pair_groups or {}).values()) if g is not None]
        if backend != "gloo":
            for group in groups:
                try:
                    group.abort()
                except Exception:  # noqa: BLE001
                    pass
            return
        for peer in peers:
            for group in groups:
                try:
                    work = dist.irecv(torch.empty(1), src=peer, group=group, tag=_ABORT_TAG)
                    work.wait(datetime.timedelta(milliseconds=1))
                except Exception:  # noqa: BLE001 - the timeout is the point
                    pass

    # ------------------------------------------------------------------ helpers
    def _post_send(self, tensor: torch.Tensor, dst: int, tag: int, acct: str) -> PendingRecv:
        record("send", _nbytes(tensor), 2, acct)
        seq = _trace.enter(f"send->{dst}", _nbytes(tensor), self.group, acct)
        pending = self._post(_isend, tensor, dst, tag, seq)
        self._sends.append(pending)
        return pending

    def _post(self, call, tensor: torch.Tensor, peer: int, tag: int, seq: int) -> PendingRecv:
        """``call`` (_isend / _irecv) of ``tensor`` with ``peer``: on the poster thread when threaded, on the (group,
        pair)'s emulated stream under the NCCL emulation."""
        group = self._group_of(self.rank, peer) if call is _isend else self._group_of(peer, self.rank)
        if not (self.threaded or self.emulate):
            return PendingRecv(tensor, call(tensor, peer, group=group, tag=tag), self.timeout, seq)
        posted = _allocate_lock()
        posted.acquire()
        pending = PendingRecv(tensor, None, self.timeout, seq, posted=posted)
        if self.emulate:
            p2p_emulate.post(pending, call, tensor, self.rank, peer, group, self.timeout)
        else:
            _poster().submit(pending, call, tensor, peer, group, tag)
        return pending

    @staticmethod
    def _header(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline activations may have at most {_MAX_DIMS} dims, got shape {tuple(tensor.shape)}")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"pipeline activations of dtype {tensor.dtype} are not supported")
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=tensor.device)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        if tensor.dim():
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        return header
