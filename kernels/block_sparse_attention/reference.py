"""Dense masked attention: the ground truth that every block-sparse path is tested against.

It materializes the full (B, H, L, L) score matrix, so it is only for tests and small shapes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def expand_layout(layout: torch.Tensor, block: int, causal: bool = False) -> torch.Tensor:
    """(H, NB, NB) block layout -> (H, L, L) bool element mask (lower triangle only when ``causal``)."""
    mask = layout.bool().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)  # (H, L, L)
    if causal:
        mask = torch.tril(mask)
    return mask


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: torch.Tensor,
    block: int,
    *,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias + key_padding_mask, restricted to the layout) v, in ``dtype``.

    q, k, v: (B, H, L, D). ``key_padding_mask``: additive (B, L). ``bias``: additive, broadcastable to
    (B, H, L, L). Rows that may attend to nothing produce zeros (the sparse paths' convention).
    Differentiable, so autograd on it gives the reference gradients.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (t.to(dtype) for t in (q, k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, L, L)
    if bias is not None:
        scores = scores + bias.to(dtype)
    if key_padding_mask is not None:
        scores = scores + key_padding_mask.to(dtype)[:, None, None, :]
    allowed = expand_layout(layout, block, causal).to(q.device)[None]  # (1, H, L, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # exp(-inf) = 0 for masked entries
    total = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    return torch.matmul(weights, v)
