"""The vocabulary cross-entropy in sequence chunks: the (B, T, V) logits never exist at once.

For a long sequence the head's logits are the largest activation of a language model: at T = 4096 and V = 32k one
sequence's fp32 logits are 512 MiB, and the loss keeps them (or their softmax) for the backward, where the
gradient takes as much again. :func:`chunked_cross_entropy` runs ``head`` and the loss ``chunk_size`` positions at
a time, each chunk under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): the forward keeps only the
hidden states, the backward recomputes one chunk's logits at a time, takes its gradient and frees it. The cost is
one extra forward of the head (a matmul of ``T x C x V``); the peak of the loss step drops from ~3 logits-sized
buffers to ~3 chunk-sized ones. Values and gradients equal the plain loss (same math; only the summation order
of the per-token losses differs: float64 agrees to ~1e-15).

Any head and any per-chunk loss compose: the project GPT passes its ``lm_head`` and :func:`lm_loss` (sum), the
tensor-parallel GPT its vocabulary-split head and the vocab-parallel cross-entropy (sum) -- the chunk's
collectives run again in the recompute, in the same order on every rank. Under ZeRO-3 the head is gathered by its
unit hooks as before (it is called once per chunk; the default units keep it in the root unit, gathered once).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# GPTConfig.loss_chunk's default: sequences longer than this many positions take the chunked loss.
DEFAULT_LOSS_CHUNK = 512


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of (..., V) logits in at least fp32 (``lm_loss``'s numerics, reduction ``sum``)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum")


def _chunk_loss(head: Callable, loss_sum: Callable, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return loss_sum(head(hidden), targets)  # (B, t, C) -> (B, t, V) -> summed loss; the logits die here


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *,
                          chunk_size: int = DEFAULT_LOSS_CHUNK, loss_sum: Optional[Callable] = None,
                          ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets``, ``chunk_size`` positions at a time.

    ``hidden``: ``(B, T, C)`` (the final norm's output); ``targets``: ``(B, T)`` ids or ``ignore_index``.
    ``loss_sum(logits, targets)``: the *summed* loss of one chunk (default :func:`cross_entropy_sum`; a
    vocabulary-parallel one under tensor parallelism). The mean is over the targets that are not ``ignore_index``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    loss_sum = loss_sum or functools.partial(cross_entropy_sum, ignore_index=ignore_index)
    run = functools.partial(_chunk_loss, head, loss_sum)
    total = None
    for h, t in zip(hidden.split(chunk_size, dim=1), targets.split(chunk_size, dim=1)):  # (B, t, C), (B, t)
        if torch.is_grad_enabled():
            part = checkpoint(run, h, t, use_reentrant=False, preserve_rng_state=False)
        else:
            part = run(h, t)
        total = part if total is None else total + part
    return total / (targets != ignore_index).sum()


__all__ = ["DEFAULT_LOSS_CHUNK", "chunked_cross_entropy", "cross_entropy_sum"]
