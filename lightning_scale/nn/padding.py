"""Padding / unpadding for sequence lengths that are not a multiple of the sparsity block.

Block-sparse layouts are defined on whole blocks, so L must be a multiple of ``block``. Pad the
batch, mask the padded keys (the returned mask does that in ``mul`` mode: 1 keeps, 0 drops), run
the model, then cut the padding off the output::

    ids, mask, pad = pad_inputs_to_block_size(64, ids, attention_mask)
    out = model(ids, key_padding_mask=mask)
    out = unpad_sequence_output(pad, out)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from lightning_scale.nn.sparsity_config import check_block


def pad_to_block_size(x: torch.Tensor, block: int, dim: int = 1, value: float = 0) -> Tuple[torch.Tensor, int]:
    """Pad ``x`` along ``dim`` with ``value`` up to a multiple of ``block``; returns (padded, pad_len)."""
    check_block(block)
    dim = dim % x.dim()
    pad_len = (-x.shape[dim]) % block
    if pad_len == 0:
        return x, 0
    widths = [0, 0] * (x.dim() - dim - 1) + [0, pad_len]  # F.pad lists the last dimension first
    return F.pad(x, widths, value=value), pad_len


def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Drop the last ``pad_len`` positions along ``dim`` (undoes :func:`pad_to_block_size`)."""
    if pad_len < 0:
        raise ValueError(f"pad_len={pad_len} must be >= 0")
    if pad_len == 0:
        return sequence_output
    return sequence_output.narrow(dim, 0, sequence_output.shape[dim] - pad_len)


def pad_inputs_to_block_size(block: int, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                             pad_token_id: int = 0) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(B, L) token ids (and optional (B, L) 1/0 mask) -> ids and mask padded to a multiple of
    ``block``, the mask 0 on padding (``mul`` mode key-padding mask), and the pad length."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len); got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    ids, pad_len = pad_to_block_size(input_ids, block, dim=1, value=pad_token_id)
    mask, _ = pad_to_block_size(attention_mask, block, dim=1, value=0)
    return ids, mask, pad_len
