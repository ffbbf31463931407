"""The conjugate communication pairs of Megatron-style tensor parallelism, as autograd functions.

Layout: private communication helpers -> autograd Functions (each forward's collective is the other's
backward) -> thin public wrappers that take an explicit ``group``. Every collective goes through
:mod:`lightning_scale.comm.collectives`, so :class:`~lightning_scale.comm.accounting.CommCounter` sees
the bytes; ``tag`` labels them (the plan tags with ``tp/<module name>``).

==================================  =================================  ===============================
wrapper                             forward                            backward
==================================  =================================  ===============================
copy_to_region                      identity                           all-reduce
reduce_from_region                  all-reduce                         identity
scatter_to_region (last dim)        keep own chunk                     all-gather
gather_from_region (last dim)       all-gather                         keep own chunk
scatter_to_sequence_region          keep own chunk along ``dim``       all-gather along ``dim``
gather_from_sequence_region         all-gather along ``dim``           reduce-scatter (or keep chunk)
reduce_scatter_to_sequence_region   reduce-scatter along ``dim``       all-gather along ``dim``
==================================  =================================  ===============================

Why the pairs: a column-parallel linear needs the full input on every rank (identity), but each rank
only sees the gradient of its own output columns, so the input's gradient is the *sum* over ranks
(all-reduce). A row-parallel linear produces partial sums (all-reduce) whose gradient every rank
already has in full (identity). Sequence parallelism splits the all-reduce into its two halves,
reduce-scatter + all-gather, around the regions (LayerNorm, dropout, residual) that work token-wise.

With a group of one rank every wrapper is the identity and builds no autograd node.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_scale.comm import collectives, pairwise

# ----------------------------------------------------------------------------- private helpers


def _reduce(x: torch.Tensor, group, tag: str) -> torch.Tensor:
    """Sum ``x`` over the group into a new tensor (the input may be shared with other autograd users)."""
    out = x.contiguous().clone()
    pairwise.all_reduce(out, group, tag=tag)  # gloo, 2 ranks, small: one exchange (the native collective else)
    return out


def _reduce_in_place(x: torch.Tensor, group, tag: str) -> torch.Tensor:
    """Sum ``x`` over the group in place; only for a fresh tensor nothing else refers to yet."""
    pairwise.all_reduce(x, group, tag=tag)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim``."""
    n = collectives.group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"tensor parallel split: dim {dim} of shape {tuple(x.shape)} is not divisible by tp={n}")
    return x.chunk(n, dim=dim)[collectives.group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group, tag: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    n = collectives.group_size(group)
    inp = x.contiguous()
    out = torch.empty((n,) + tuple(inp.shape), dtype=inp.dtype, device=inp.device)  # (N, *x.shape)
    collectives.all_gather(out.view(-1), inp.view(-1), group, tag=tag)  # flat: backends check dim 0
    if dim == 0:
        return out.view((n * inp.shape[0],) + tuple(inp.shape[1:]))
    return torch.cat(out.unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group, tag: str) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    out, handle = _reduce_scatter_async(x, dim, group, tag)
    handle.wait()
    return out


def _reduce_async(x: torch.Tensor, group, tag: str) -> collectives.Handle:
    """Start an in-place all-reduce of ``x`` (which the caller owns); ``wait()`` the handle before use."""
    return pairwise.all_reduce(x, group, tag=tag, async_op=True)


def _reduce_scatter_async(x: torch.Tensor, dim: int, group, tag: str):
    """Start a reduce-scatter along ``dim``; returns (output, handle). ``wait()`` before reading the output."""
    n = collectives.group_size(group)
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence parallel reduce-scatter: dim {dim} of shape {tuple(x.shape)} is not divisible by tp={n}"
        )
    inp = x.contiguous() if dim == 0 else torch.stack(x.chunk(n, dim=dim))  # (N, *chunk): one block per rank
    chunk_shape = list(x.shape)
    chunk_shape[dim] //= n
    out = torch.empty(chunk_shape, dtype=x.dtype, device=x.device)
    handle = collectives.reduce_scatter(out.view(-1), inp.reshape(-1), group, tag=tag, async_op=True)
    return out, handle


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


# ----------------------------------------------------------------------------- autograd functions


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group, ctx.tag), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        return _reduce(x, group, tag)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group, ctx.tag = dim, group, tag
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group, ctx.tag), None, None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather forward; backward either keeps the own chunk or reduce-scatters partial gradients."""

    @staticmethod
    def forward(ctx, x, dim, group, tag, grad_reduce_scatter):
        ctx.dim, ctx.group, ctx.tag, ctx.grad_reduce_scatter = dim, group, tag, grad_reduce_scatter
        return _gather(x, dim, group, tag)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_reduce_scatter:
            out = _reduce_scatter(grad, ctx.dim, ctx.group, ctx.tag)
        else:
            out = _split(grad, ctx.dim, ctx.group)
        return out, None, None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group, ctx.tag = dim, group, tag
        return _reduce_scatter(x, dim, group, tag)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group, ctx.tag), None, None, None


# ----------------------------------------------------------------------------- public wrappers


def _trivial(group) -> bool:
    return collectives.group_size(group) == 1


@collectives.eager_under_compile  # a graph break: traced, Dynamo guarded on each tag
def copy_to_region(x: torch.Tensor, group, *, tag: str = "") -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return x if _trivial(group) else _CopyToRegion.apply(x, group, tag)


@collectives.eager_under_compile  # a graph break: traced, Dynamo guarded on each tag
def reduce_from_region(x: torch.Tensor, group, *, tag: str = "") -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce forward (partial sums -> full), identity backward."""
    return x if _trivial(group) else _ReduceFromRegion.apply(x, group, tag)


@collectives.eager_under_compile  # a graph break: traced, Dynamo guarded on each tag
def scatter_to_region(x: torch.Tensor, group, *, tag: str = "") -> torch.Tensor:
    """Keep this rank's chunk of the last dim; the gradient is all-gathered."""
    return x if _trivial(group) else _ScatterToRegion.apply(x, x.dim() - 1, group, tag)


@collectives.eager_under_compile  # a graph break: traced, Dynamo guarded on each tag
def gather_from_region(x: torch.Tensor, group, *, tag: str = "") -> torch.Tensor:
    """All-gather the last dim (e.g. a column-parallel output); the gradient keeps the own chunk."""
    return x if _trivial(group) else _GatherFromRegion.apply(x, x.dim() - 1, group, tag, False)


@collectives.eager_under_compile  # a graph break: traced, Dynamo guarded on each tag
def scatter_to_sequence_region(x: torch.Tensor, group, *, dim: int = -2, tag: str = "") -> torch.Tensor:
    """Keep this rank's chunk of the sequence dim of a replicated tensor; the gradient is all-gathered."""
    return x if _trivial(group) else _ScatterToRegion.apply(x, _norm_dim(x, dim), group, tag)


@collectives.eager_under_compile  # a graph break: traced, Dynamo guarded on each tag
def gather_from_sequence_region(x: torch.Tensor, group, *, dim: int = -2, grad_reduce_scatter: bool = True,
                                tag: str = "") -> torch.Tensor:
    """All-gather the sequence dim before a column-parallel layer.

    The consumer's input gradient is a per-rank partial sum, so by default the backward reduce-scatters
    it; pass ``grad_reduce_scatter=False`` when the consumer is replicated (gradient already full).
    """
    if _trivial(group):
        return x
    return _GatherFromRegion.apply(x, _norm_dim(x, dim), group, tag, grad_reduce_scatter)


@collectives.eager_under_compile  # a graph break: traced, Dynamo guarded on each tag
def reduce_scatter_to_sequence_region(x: torch.Tensor, group, *, dim: int = -2, tag: str = "") -> torch.Tensor:
    """Sum a row-parallel output over ranks and keep this rank's sequence chunk; backward all-gathers."""
    return x if _trivial(group) else _ReduceScatterToRegion.apply(x, _norm_dim(x, dim), group, tag)


def tp_size(group: Optional[object]) -> int:
    return collectives.group_size(group)


def tp_rank(group: Optional[object]) -> int:
    return collectives.group_rank(group)
