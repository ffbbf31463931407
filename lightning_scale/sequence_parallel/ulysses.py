"""Ulysses sequence parallelism, the model-independent part (DeepSpeed-Ulysses, https://arxiv.org/abs/2309.14509).

Each of the ``sp`` ranks of a sequence-parallel group holds ``L / sp`` consecutive positions of every sequence.
Everything but attention is position-wise, so it runs on the local slice unchanged. Attention needs every position:
q, k and v go through one all-to-all that scatters heads and gathers the sequence (each rank then holds
``H / sp`` heads over all ``L`` positions), the unchanged attention runs on those heads, and the inverse all-to-all
brings the output back to ``L / sp`` positions of all heads. Each all-to-all is an autograd function whose backward is
the inverse all-to-all, so the backward crosses ranks at the same two points.

The loss is the mean over the whole sequence: :func:`sequence_mean` combines each rank's partial sum and count over
the group. Its backward multiplies by ``sp``: each sp rank's parameter gradients are partial sums of the full
sequence's gradient (the all-to-all backward carries the cross-position terms), and the ZeRO engines average over
dp x sp; times ``sp`` that average is the mean over dp of the sp sums.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import torch

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Chunk j of ``x`` along ``scatter_dim`` goes to rank j; what rank j sends is concatenated at j along
    ``gather_dim``."""
    n = C.group_size(group)
    if n == 1:
        return x
    send = torch.stack(x.chunk(n, dim=scatter_dim)).contiguous()  # (n, *chunk)
    recv = torch.empty_like(send)
    C.all_to_all(recv, send, group, tag="sp/all_to_all")
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The all-to-all with its inverse as the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Differentiable all-to-all over ``group``: ``x`` split along ``scatter_dim``, gathered along ``gather_dim``."""
    if x.shape[scatter_dim] % C.group_size(group):
        raise ValueError(f"all_to_all: dimension {scatter_dim} of size {x.shape[scatter_dim]} does not split over "
                         f"{C.group_size(group)} ranks")
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def heads_to_sequence(tensors: Sequence[torch.Tensor], group, head_dim: int = 1, seq_dim: int = 2
                      ) -> Tuple[torch.Tensor, ...]:
    """(B, H, L/sp, D) pieces -> (B, H/sp, L, D): same-shaped tensors travel in one all-to-all."""
    if len({tuple(t.shape) for t in tensors}) == 1:
        stacked = all_to_all(torch.stack(tuple(tensors)), head_dim + 1, seq_dim + 1, group)
        return tuple(stacked.unbind(0))
    return tuple(all_to_all(t, head_dim, seq_dim, group) for t in tensors)


def sequence_to_heads(x: torch.Tensor, group, head_dim: int = 1, seq_dim: int = 2) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`: (B, H/sp, L, D) -> (B, H, L/sp, D)."""
    return all_to_all(x, seq_dim, head_dim, group)


class _SequenceMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_sum: torch.Tensor, count: torch.Tensor, group) -> torch.Tensor:
        buf = torch.stack([local_sum.detach(), count.detach().to(local_sum.dtype)])
        C.all_reduce(buf, group, tag="sp/loss")
        ctx.scale = C.group_size(group) / buf[1]
        return buf[0] / buf[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale.to(grad.dtype), None, None


def sequence_mean(local_sum: torch.Tensor, count: torch.Tensor, group) -> torch.Tensor:
    """The loss over the whole sequence: (sum over the group of ``local_sum``) / (sum of ``count``), equal on every
    rank of ``group``. Backward: ``sp / total count`` into ``local_sum`` (see the module docstring)."""
    return _SequenceMean.apply(local_sum, count, group)


@torch.no_grad()
def next_token_labels(labels: torch.Tensor, group, ignore_index: int = -100) -> torch.Tensor:
    """Unshifted (B, L/sp) labels of this rank's slice -> the labels its positions predict (B, L/sp): the slice
    shifted by one, its last column the first label of the next rank's slice (``ignore_index`` on the last rank).
    A collective (an all-gather of each rank's first column)."""
    n, r = C.group_size(group), C.group_rank(group)
    first = labels[:, :1].contiguous()
    every = torch.empty((n,) + tuple(first.shape), dtype=first.dtype, device=first.device)
    C.all_gather(every, first, group, tag="sp/labels")
    tail = every[r + 1] if r + 1 < n else torch.full_like(first, ignore_index)
    return torch.cat([labels[:, 1:], tail], dim=1)


def shard_sequence(batch: Any, rank: int, size: int, dim: int = 1) -> Any:
    """This sp rank's slice of a batch: every tensor with at least two dimensions is cut along ``dim`` (the
    sequence) into ``size`` equal parts, part ``rank`` kept (a view); other tensors and values pass unchanged.
    Tuples, lists and mappings are walked. A length that ``size`` does not divide is a ConfigError."""
    if size == 1:
        return batch
    if torch.is_tensor(batch):
        if batch.dim() <= dim:
            return batch
        length = batch.shape[dim]
        if length % size:
            raise ConfigError(f"sp={size} does not divide the batch's sequence length {length} (dimension {dim} of "
                              f"a {tuple(batch.shape)} tensor); pad or crop the sequences to a multiple of sp")
        part = length // size
        return batch.narrow(dim, rank * part, part)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(shard_sequence(b, rank, size, dim) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(shard_sequence(b, rank, size, dim) for b in batch)
    if isinstance(batch, dict):
        items = {k: shard_sequence(v, rank, size, dim) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    return batch


__all__ = ["all_to_all", "heads_to_sequence", "sequence_to_heads", "sequence_mean", "next_token_labels",
           "shard_sequence"]
