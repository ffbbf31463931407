"""The p2p poster thread (gloo isend / irecv made off the caller's thread) and the receive-buffer pool, without
processes: fake calls stand in for dist.isend / dist.irecv."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch

from lightning_scale.comm import p2p
from lightning_scale.pipeline.runtime import _storage_unshared


class _Work:
    def __init__(self, log=None, tag=None):
        self.log, self.tag, self.waited = log, tag, False

    def wait(self, timeout=None):
        self.waited = True
        if self.log is not None:
            self.log.append(("wait", self.tag))

    def is_completed(self):
        return self.waited


def _pending(timeout=None):
    lock = p2p._allocate_lock()
    lock.acquire()
    return p2p.PendingRecv(torch.zeros(1), None, timeout, posted=lock)


def test_poster_calls_in_submission_order_and_waits_follow_posts():
    calls = []

    def call(tensor, peer, *, group, tag):
        calls.append(tag)
        return _Work()

    handles = []
    for k in range(200):
        h = _pending()
        p2p._poster().submit(h, call, h.tensor, 1, None, k)
        handles.append(h)
    for h in handles:
        h.wait()
        assert h.is_completed()
    assert calls == list(range(200))  # FIFO: messages of one channel keep their order


def test_not_completed_until_posted_and_wait_blocks_for_the_post():
    gate, work = threading.Event(), _Work()

    def slow_call(tensor, peer, *, group, tag):
        gate.wait(10)
        return work

    h = _pending(datetime.timedelta(seconds=10))
    p2p._poster().submit(h, slow_call, h.tensor, 1, None, 0)
    assert not h.is_completed()  # not posted yet: there is no work object to ask
    threading.Timer(0.2, gate.set).start()
    assert h.wait() is h.tensor and work.waited  # waited for the post, then for the transfer
    assert h.is_completed()
    h.wait()  # twice is free


def test_a_failed_post_raises_at_wait_and_counts_as_completed():
    def bad(tensor, peer, *, group, tag):
        raise RuntimeError("Connection closed by peer")

    h = _pending(datetime.timedelta(seconds=10))
    p2p._poster().submit(h, bad, h.tensor, 1, None, 0)
    with pytest.raises(RuntimeError, match="Connection closed"):
        h.wait()
    assert h.is_completed()  # pruned from the detached list, not kept forever


def test_wait_for_a_post_is_bounded():
    gate = threading.Event()
    h = _pending(datetime.timedelta(milliseconds=100))
    p2p._poster().submit(h, lambda *a, **k: gate.wait(5) and _Work(), h.tensor, 1, None, 0)
    with pytest.raises(RuntimeError, match="did not post"):
        h.wait()
    gate.set()


def test_forked_child_starts_its_own_poster():
    parent = p2p._poster()
    pid = os.fork()
    if pid == 0:  # child: the parent's thread does not exist here
        ok = p2p._POSTER is None and p2p._poster().pid == os.getpid() and p2p._poster()._thread.is_alive()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert p2p._poster() is parent


def test_threaded_only_under_gloo_and_switchable(monkeypatch):
    assert p2p.P2P(None).threaded is False  # no group: nothing to post through
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group: "gloo")
    assert p2p.P2P(object()).threaded is True
    monkeypatch.setenv(p2p.THREAD_ENV, "0")
    assert p2p.P2P(object()).threaded is False
    assert p2p.P2P(object(), threaded=True).threaded is True
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group: "nccl")
    monkeypatch.delenv(p2p.THREAD_ENV)
    assert p2p.P2P(object()).threaded is False  # NCCL's calls only enqueue


def test_recycled_buffers_are_kept_per_shape_and_only_whole_cpu_tensors():
    link = p2p.P2P(None, threaded=False)
    a = torch.empty(2, 3)
    link.recycle(a)
    link.recycle(torch.empty(4, 3)[1:3])  # a view into a bigger buffer: not a receive buffer
    link.recycle(torch.empty(3, 2).t())  # not contiguous
    for _ in range(6):
        link.recycle(torch.empty(2, 3))
    assert len(link._free[(torch.Size([2, 3]), torch.float32)]) == 2 and link._free[(a.shape, a.dtype)][0] is a
    assert list(link._free) == [(torch.Size([2, 3]), torch.float32)]
    link.release_free()
    assert link._free == {}
    link.recycle(a)
    link.reset()
    assert link._free == {}


def test_storage_shared_with_a_view_or_alias_is_not_recycled():
    g = torch.randn(2, 3)
    assert _storage_unshared(g)
    v = g.view(6)
    assert not _storage_unshared(g)
    del v
    assert _storage_unshared(g)
    alias = g.detach()
    assert not _storage_unshared(g)
    del alias
