"""Reduce-scatter and all-gather on gloo as direct pairwise sends, for the ZeRO engines' flat buckets.

Gloo's own ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are slow on CPU: measured on 2 ranks
(26 MB fp32 bucket, one thread per rank, load ~7), reduce-scatter 99-101 ms and all-gather 83-100 ms, against
59-80 ms for the *whole* all-reduce DDP runs, while the same exchanges as point-to-point sends take 38-40 ms
(reduce-scatter) and 29-30 ms (all-gather): ZeRO 1-2 moved the same bytes as DDP at ~2.5x its communication time.

Here every rank sends chunk ``j`` of its input straight to rank ``j`` and receives its own chunk from every peer
(``batch_isend_irecv``), then sums the chunks in rank order (reduce-scatter); the all-gather sends its shard to
every peer and receives theirs into place. Per rank that is ``(N - 1) / N`` of the buffer out and in, the same
bytes as a ring, and the accounting (:mod:`.accounting`) records the same collective. On 2 ranks the sum is one
``a + b`` (exact whatever the order); on N > 2 it is a fixed left-to-right sum in rank order. Other backends
(NCCL, ...) take the native collectives of :mod:`.collectives`.
"""

from __future__ import annotations

import sys
from typing import List

import torch
import torch.distributed as dist

from lightning_scale.comm import collectives as C
from lightning_scale.comm.accounting import record
from lightning_scale.diagnostics import trace as _trace

# Point-to-point tags of these exchanges (gloo matches a pair's messages per tag in posting order; every rank posts
# the engines' collectives in the same order). Distinct from the pipeline's p2p tags and from a user's tag 0.
_TAG_REDUCE_SCATTER = 0x2E5C
_TAG_ALL_GATHER = 0x2E5D
_TAG_ALL_REDUCE = 0x2E5E
# all_reduce goes point to point only up to this size: one full-size exchange instead of gloo's two half-size ring
# rounds saves a latency, which is what counts for a tensor-parallel activation (0.25 MiB: 0.49 -> 0.26 ms, 1 MiB:
# 2.5 -> 1.3-1.7 ms on 2 ranks, one thread each); at 4 MiB both are ~3.5 ms, and past it the ring's halves win
ALL_REDUCE_MAX_BYTES = 4 << 20


class _Works:
    """Several point-to-point works waited as one."""

    def __init__(self, works: List) -> None:
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def uses_pairwise(group=None) -> bool:
    """Whether this group's reduce-scatter / all-gather go point to point (gloo, more than one rank)."""
    return C.group_size(group) > 1 and C._backend(group) == "gloo"


def _peers(group) -> List[int]:
    """Global ranks of the group's members, in group-rank order."""
    n = C.group_size(group)
    if group is None:
        return list(range(n))
    return [dist.get_global_rank(group, j) for j in range(n)]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' bytes overlap (same storage, intersecting ranges)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _begin(name: str, full: torch.Tensor, shard: torch.Tensor, group, tag: str, async_op: bool):
    """The shared start of both exchanges: the size check, the accounting record and the trace entry.

    Returns ``(n, me, peers, seq)``: the group size, this rank's group rank, the members' global ranks and the
    trace sequence number the result closes."""
    n = C.group_size(group)
    if full.numel() != n * shard.numel():
        raise ValueError(f"{name}: full numel {full.numel()} != {n} x shard numel {shard.numel()}")
    record(name, C._nbytes(full), n, tag)
    return n, C.group_rank(group), _peers(group), _trace.enter(name, C._nbytes(full), group, tag, not async_op)


@C._eager
def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group=None, *, async_op: bool = False, tag: str = ""):
    """Like :func:`.collectives.reduce_scatter` (sum of ``inp`` over the group, rank r gets chunk r in ``out``)."""
    if not uses_pairwise(group):
        return C.reduce_scatter(out, inp, group, async_op=async_op, tag=tag)
    n, me, peers, seq = _begin("reduce_scatter", inp, out, group, tag, async_op)
    chunks = inp.reshape(-1).chunk(n)
    flat_out = out.view(-1)
    if n == 2 and not _overlaps(flat_out, inp):
        # the peer's chunk lands in ``out`` itself, then ``out += own``: a + b is exact in either order, and no
        # receive buffer is held (at ZeRO-3 with two buckets in flight that was ~25 MB on the tune probe's GPT,
        # past the memory plan's 15%)
        peer = 1 - me
        ops = [dist.P2POp(dist.isend, chunks[peer], peers[peer], group, _TAG_REDUCE_SCATTER),
               dist.P2POp(dist.irecv, flat_out, peers[peer], group, _TAG_REDUCE_SCATTER)]
        return C._result(_Works(dist.batch_isend_irecv(ops)), async_op, lambda: flat_out.add_(chunks[me]), seq=seq)
    recv = torch.empty((n - 1, out.numel()), dtype=inp.dtype, device=inp.device)  # (peers, shard)
    ops, row = [], {}
    for j in range(n):
        if j == me:
            continue
        row[j] = len(row)
        ops.append(dist.P2POp(dist.isend, chunks[j], peers[j], group, _TAG_REDUCE_SCATTER))
        ops.append(dist.P2POp(dist.irecv, recv[row[j]], peers[j], group, _TAG_REDUCE_SCATTER))
    works = dist.batch_isend_irecv(ops)

    def finish() -> None:
        parts = [chunks[j] if j == me else recv[row[j]] for j in range(n)]  # rank order
        torch.add(parts[0], parts[1], out=flat_out)
        for p in parts[2:]:
            flat_out.add_(p)

    return C._result(_Works(works), async_op, finish, seq=seq)


@C._eager
def all_gather(out: torch.Tensor, inp: torch.Tensor, group=None, *, async_op: bool = False, tag: str = ""):
    """Like :func:`.collectives.all_gather`; ``inp`` may be ``out``'s own chunk (in place: nothing is copied)."""
    if not uses_pairwise(group):
        return C.all_gather(out, inp, group, async_op=async_op, tag=tag)
    n, me, peers, seq = _begin("all_gather", out, inp, group, tag, async_op)
    chunks = out.view(-1).chunk(n)
    src = inp.reshape(-1)
    if src.data_ptr() != chunks[me].data_ptr():
        chunks[me].copy_(src)
    ops = []
    for j in range(n):
        if j == me:
            continue
        ops.append(dist.P2POp(dist.isend, chunks[me], peers[j], group, _TAG_ALL_GATHER))
        ops.append(dist.P2POp(dist.irecv, chunks[j], peers[j], group, _TAG_ALL_GATHER))
    return C._result(_Works(dist.batch_isend_irecv(ops)), async_op, seq=seq)


@C._eager
def all_reduce(buf: torch.Tensor, group=None, *, async_op: bool = False, tag: str = ""):
    """Like :func:`.collectives.all_reduce` (in-place sum): on a 2-rank gloo group and up to
    :data:`ALL_REDUCE_MAX_BYTES`, one exchange of the whole tensor with the peer and ``buf += received``; ``a + b`` is
    exact in either order, so both ranks hold the same bits as gloo's ring gives. Otherwise the native collective."""
    if not (C.group_size(group) == 2 and C._backend(group) == "gloo" and C._nbytes(buf) <= ALL_REDUCE_MAX_BYTES
            and buf.is_contiguous()):
        return C.all_reduce(buf, group, async_op=async_op, tag=tag)
    record("all_reduce", C._nbytes(buf), 2, tag)
    seq = _trace.enter("all_reduce", C._nbytes(buf), group, tag, not async_op)
    peer = _peers(group)[1 - C.group_rank(group)]
    recv = torch.empty_like(buf)
    ops = [dist.P2POp(dist.isend, buf, peer, group, _TAG_ALL_REDUCE),
           dist.P2POp(dist.irecv, recv, peer, group, _TAG_ALL_REDUCE)]
    return C._result(_Works(dist.batch_isend_irecv(ops)), async_op, lambda: buf.add_(recv), seq=seq)


if "torch._dynamo" in sys.modules:  # imported after Dynamo: these two are graph breaks as well (collectives' rule)
    C._disable_under_dynamo()
