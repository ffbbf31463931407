"""Row-parallel forward with its all-reduce overlapped with the layer's own remaining compute (opt-in).

A row-parallel layer's output rows (tokens) are independent: the input rows are split into ``chunks``; chunk
``i``'s partial sums are all-reduced asynchronously while chunk ``i + 1``'s matmul runs (the idea of
Megatron-LM / torchtitan async TP and DeepSpeed Domino's split batches, within one layer). Only the last
chunk's all-reduce is exposed. ``blocking=True`` runs the same chunks with every all-reduce waited at once,
so the two paths are bit-identical (same matmuls, same elementwise sums); against ``chunks=1`` the results
agree to rounding (a BLAS may pick another kernel for fewer rows).

    set_overlap(model, chunks=2)      # every RowParallelLinear of a tensor-parallel model

``trace_overlap()`` records (event, tag, chunk, time) tuples so a test can see the collective in flight.
"""

from __future__ import annotations

import contextlib
import time
from typing import List, Optional

import torch
import torch.nn as nn

from lightning_scale.comm import pairwise

_TRACE: Optional[List[tuple]] = None


@contextlib.contextmanager
def trace_overlap():
    """Record ("mm_start" | "mm_end" | "post" | "wait_start" | "wait_end", tag, chunk, t) while inside."""
    global _TRACE
    events: List[tuple] = []
    old, _TRACE = _TRACE, events
    try:
        yield events
    finally:
        _TRACE = old


def _mark(event: str, tag: str, chunk: int) -> None:
    if _TRACE is not None:
        _TRACE.append((event, tag, chunk, time.perf_counter()))


def set_overlap(model: nn.Module, chunks: int = 2, *, blocking: bool = False) -> int:
    """Split every ``RowParallelLinear``'s forward into ``chunks`` row chunks (1: off). Returns how many layers."""
    from lightning_scale.tensor_parallel.layers import RowParallelLinear

    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"set_overlap: chunks={chunks!r} must be an int >= 1")
    n = 0
    for module in model.modules():
        if isinstance(module, RowParallelLinear):
            module.overlap_chunks, module.overlap_blocking = chunks, blocking
            n += 1
    return n


def row_linear_chunked(x: torch.Tensor, weight: torch.Tensor, group, tag: str, transposed: bool, chunks: int,
                       blocking: bool) -> torch.Tensor:
    """``all_reduce(x W^T)`` computed ``chunks`` rows at a time, each chunk's all-reduce in flight during the next
    chunk's matmul. x (*, T, in_local) -> (*, T, out)."""
    w = weight if transposed else weight.t()  # (in_local, out)
    x2 = x.reshape(-1, x.shape[-1])  # (N, in_local)
    y2 = x2.new_empty(x2.shape[0], w.shape[1])  # (N, out)
    handles = []
    pieces = [(xs, ys) for xs, ys in zip(x2.tensor_split(chunks), y2.tensor_split(chunks)) if xs.shape[0]]
    for i, (xs, ys) in enumerate(pieces):
        _mark("mm_start", tag, i)
        torch.mm(xs, w, out=ys)
        _mark("mm_end", tag, i)
        handles.append(pairwise.all_reduce(ys, group, tag=tag, async_op=True))
        _mark("post", tag, i)
        if blocking:
            _mark("wait_start", tag, i)
            handles[-1].wait()
            _mark("wait_end", tag, i)
    if not blocking:
        for i, h in enumerate(handles):
            _mark("wait_start", tag, i)
            h.wait()
            _mark("wait_end", tag, i)
    return y2.view(tuple(x.shape[:-1]) + (w.shape[1],))
