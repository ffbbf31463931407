"""Collectives on flat buffers, with async handles, backend fallbacks and byte accounting.

Every function takes an explicit ``group`` (``None`` means the default world group) and returns a
:class:`Handle` when ``async_op=True`` so gradient reduction can overlap the backward pass. Where a
backend lacks ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` (older gloo builds, some
third-party backends) the same result is produced through ``all_to_all`` (reduce-scatter) or the
list form of ``all_gather``; both move the same number of bytes, so accounting stays exact.

Under ``torch.compile`` every collective here (and ``Handle.wait``) is a deliberate graph break
(``torch.compiler.disable``, applied when Dynamo is imported, so a process that never compiles never imports it): the
collective, its accounting and the hang watchdog's trace run eagerly between compiled regions, instead of Dynamo
tracing the bookkeeping and recompiling on its counters (about 1 us per call in eager mode once applied).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from lightning_scale._import_hook import run_after_import
from lightning_scale.comm.accounting import record
from lightning_scale.diagnostics import trace as _trace

def _eager(fn: Callable) -> Callable:
    """A graph break under torch.compile (module docstring). ``torch.compiler.disable`` imports Dynamo (and triton),
    seconds that a CLI or a rank that never compiles should not pay: the function goes through a one-entry
    indirection that becomes the disabled wrapper once ``torch._dynamo`` is imported (before anything compiles)."""
    impl = [fn]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return impl[0](*args, **kwargs)

    _EAGER.append((impl, fn))
    _WRAPPER_CODE[:] = [call.__code__]  # one code object for every wrapper
    if _DYNAMO_SEEN:  # defined after Dynamo's import (another module's @eager_under_compile): disabled at once
        impl[0] = torch.compiler.disable(fn)
    return call


eager_under_compile = _eager  # for other modules (the tensor-parallel layers' forwards)
_EAGER: list = []
_DYNAMO_SEEN: list = []
_WRAPPER_CODE: list = []


def _disable_under_dynamo(_module=None) -> None:
    _DYNAMO_SEEN.append(True)
    for impl, fn in _EAGER:
        impl[0] = torch.compiler.disable(fn)
    # The indirection itself (one code object for every wrapper) is never a frame Dynamo compiles: traced as its
    # own frame after the graph break it holds, it recompiled per grad mode / caller and, once past the recompile
    # limit, showed as an eager fallback in compile_stats.
    skip = getattr(getattr(_module, "eval_frame", None), "skip_code", None)
    if skip is not None:
        for code in _WRAPPER_CODE:
            skip(code)

# (backend, op) -> True when the native collective failed once and the fallback is used.
_NATIVE_BROKEN: Dict[Tuple[str, str], bool] = {}

_reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle:
    """An in-flight collective: ``wait()`` blocks until done and runs any post-processing."""

    def __init__(self, work=None, finish: Optional[Callable[[], None]] = None, seq: int = 0) -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self._seq = seq  # diagnostics: the watchdog sees which collective this rank is blocked in

    @_eager
    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            if self._seq:
                _trace.wait_begin(self._seq)
                self._work.wait()
                _trace.wait_end(self._seq)
            else:
                self._work.wait()
        if self._finish is not None:
            self._finish()
        self._done = True

    def is_completed(self) -> bool:
        """Whether the collective has finished, without waiting (``wait()`` still runs the post-processing)."""
        return self._done or self._work is None or self._work.is_completed()


_DONE = Handle()
_DONE._done = True


def group_size(group=None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _backend(group) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # pragma: no cover - exotic groups
        return "unknown"


def _result(work, async_op: bool, finish: Optional[Callable[[], None]] = None, seq: int = 0) -> Optional[Handle]:
    handle = Handle(work, finish, seq)
    if async_op:
        return handle
    handle.wait()
    if seq:
        _trace.wait_end(seq)  # a blocking call: its wait began at _trace.enter
    return None


@_eager
def all_reduce(buf: torch.Tensor, group=None, *, op=dist.ReduceOp.SUM, async_op: bool = False, tag: str = ""):
    """In-place all-reduce of ``buf`` over ``group``."""
    n = group_size(group)
    if n == 1:
        return _DONE if async_op else None
    record("all_reduce", _nbytes(buf), n, tag)
    seq = _trace.enter("all_reduce", _nbytes(buf), group, tag, not async_op)
    work = dist.all_reduce(buf, op=op, group=group, async_op=async_op)
    return _result(work, async_op, seq=seq)


@_eager
def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group=None, *, async_op: bool = False,
                   tag: str = "", fallback: Optional[bool] = None):
    """Sum ``inp`` (numel = N * out.numel()) over the group; rank r receives chunk r in ``out``."""
    n = group_size(group)
    if inp.numel() != n * out.numel():
        raise ValueError(f"reduce_scatter: input numel {inp.numel()} != {n} x output numel {out.numel()}")
    if n == 1:
        out.copy_(inp.view_as(out))
        return _DONE if async_op else None
    record("reduce_scatter", _nbytes(inp), n, tag)
    seq = _trace.enter("reduce_scatter", _nbytes(inp), group, tag, not async_op)
    key = (_backend(group), "reduce_scatter")
    use_fallback = _NATIVE_BROKEN.get(key, False) if fallback is None else fallback
    if not use_fallback:
        try:  # flat views: gloo logs a fatal-looking check and slows down on multi-dimensional tensors
            work = _reduce_scatter_native(out.view(-1), inp.view(-1), group=group, async_op=async_op)
            return _result(work, async_op, seq=seq)
        except (RuntimeError, NotImplementedError):
            _NATIVE_BROKEN[key] = True
    # Fallback: all_to_all sends chunk j to rank j; each rank then sums the N chunks it received.
    recv = torch.empty(inp.numel(), dtype=inp.dtype, device=inp.device)
    work = dist.all_to_all_single(recv, inp.reshape(-1).contiguous(), group=group, async_op=async_op)

    def finish() -> None:
        torch.sum(recv.view(n, -1), dim=0, out=out.view(-1))

    return _result(work, async_op, finish, seq=seq)


@_eager
def all_gather(out: torch.Tensor, inp: torch.Tensor, group=None, *, async_op: bool = False,
               tag: str = "", fallback: Optional[bool] = None):
    """Concatenate every rank's ``inp`` into ``out`` (numel = N * inp.numel()), in rank order."""
    n = group_size(group)
    if out.numel() != n * inp.numel():
        raise ValueError(f"all_gather: output numel {out.numel()} != {n} x input numel {inp.numel()}")
    if n == 1:
        out.view(-1).copy_(inp.reshape(-1))
        return _DONE if async_op else None
    record("all_gather", _nbytes(out), n, tag)
    seq = _trace.enter("all_gather", _nbytes(out), group, tag, not async_op)
    key = (_backend(group), "all_gather")
    use_fallback = _NATIVE_BROKEN.get(key, False) if fallback is None else fallback
    if not use_fallback:
        try:
            work = _all_gather_native(out.view(-1), inp.reshape(-1), group=group, async_op=async_op)
            return _result(work, async_op, seq=seq)
        except (RuntimeError, NotImplementedError):
            _NATIVE_BROKEN[key] = True
    chunks = list(out.view(n, -1).unbind(0))
    work = dist.all_gather(chunks, inp.reshape(-1).contiguous(), group=group, async_op=async_op)
    return _result(work, async_op, seq=seq)


@_eager
def all_to_all(out: torch.Tensor, inp: torch.Tensor, group=None, *, async_op: bool = False, tag: str = ""):
    """Chunk j of ``inp`` goes to rank j; chunk i of ``out`` comes from rank i."""
    n = group_size(group)
    if n == 1:
        out.copy_(inp)
        return _DONE if async_op else None
    record("all_to_all", _nbytes(inp), n, tag)
    seq = _trace.enter("all_to_all", _nbytes(inp), group, tag, not async_op)
    work = dist.all_to_all_single(out, inp, group=group, async_op=async_op)
    return _result(work, async_op, seq=seq)


@_eager
def all_to_all_v(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group=None, *, tag: str = ""):
    """Uneven all-to-all along dim 0: the first ``in_splits[0]`` rows of ``inp`` go to rank 0, the next
    ``in_splits[1]`` to rank 1...; ``out`` receives ``out_splits[i]`` rows from rank i, in rank order. Blocking.
    Accounted as the rows this rank sends (mixture-of-experts token exchange)."""
    n = group_size(group)
    if n == 1:
        out.copy_(inp)
        return None
    row = _nbytes(inp) // max(1, inp.shape[0]) if inp.dim() else 0
    others = (sum(in_splits) - in_splits[group_rank(group)]) * row  # the rows kept here do not move
    record("all_to_all", others * n // (n - 1), n, tag)
    seq = _trace.enter("all_to_all", _nbytes(inp), group, tag, True)
    work = dist.all_to_all_single(out, inp, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                                  group=group, async_op=False)
    return _result(work, False, seq=seq)


@_eager
def broadcast(buf: torch.Tensor, src: int, group=None, *, async_op: bool = False, tag: str = ""):
    """Broadcast ``buf`` from global rank ``src``."""
    n = group_size(group)
    if n == 1:
        return _DONE if async_op else None
    record("broadcast", _nbytes(buf), n, tag)
    seq = _trace.enter("broadcast", _nbytes(buf), group, tag, not async_op)
    work = dist.broadcast(buf, src=src, group=group, async_op=async_op)
    return _result(work, async_op, seq=seq)


run_after_import("torch._dynamo", _disable_under_dynamo)  # every @_eager function is defined above
