"""Conversion between block layouts and torch FlexAttention's ``BlockMask`` (for cross-checking).

FlexAttention (``torch.nn.attention.flex_attention``) skips the blocks a ``BlockMask`` leaves out,
so the same sparsity can be run through it and compared with our kernels, on the CPU (forward only)
and on the GPU (where it is the natural speed peer). Blocks on the diagonal of a causal layout are
"partial" (the ``mask_mod`` masks the future inside them); every other listed block is "full".
Requires torch >= 2.5 (FlexAttention).
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from lightning_scale.kernels.block_sparse_attention.index import causal_layout


def layout_mask_mod(layout: torch.Tensor, block: int, causal: bool = False) -> Callable:
    """A FlexAttention ``mask_mod`` that evaluates the layout element-wise (for ``create_block_mask``)."""
    fine = causal_layout(layout, causal)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = fine.to(q_idx.device)[h, q_idx // block, kv_idx // block]
        return keep & (q_idx >= kv_idx) if causal else keep

    return mask_mod


def _kv_lists(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(H, NQ, NKV) bool -> counts (1, H, NQ) int32, indices (1, H, NQ, NKV) int32 (listed blocks first)."""
    nkv = blocks.shape[-1]
    order = torch.arange(nkv, device=blocks.device).expand_as(blocks)
    # Sort key: listed blocks first, in ascending column order.
    keys = torch.where(blocks, order, order + nkv)
    indices = keys.argsort(dim=-1) if nkv else keys
    return blocks.sum(-1, dtype=torch.int32)[None], indices.to(torch.int32)[None]


def layout_to_block_mask(layout: torch.Tensor, block: int, causal: bool = False, device=None):
    """(H, NB, NB) layout -> ``BlockMask`` of block size ``block`` (batch dimension broadcast)."""
    from torch.nn.attention.flex_attention import BlockMask

    fine = causal_layout(layout, causal).to(device) if device is not None else causal_layout(layout, causal)
    nb = fine.shape[-1]
    if causal:
        diagonal = torch.eye(nb, dtype=torch.bool, device=fine.device).expand_as(fine)
        partial, full = fine & diagonal, fine & ~diagonal
    else:
        partial, full = torch.zeros_like(fine), fine
    kv_num, kv_idx = _kv_lists(partial)
    full_num, full_idx = _kv_lists(full)
    seq_len = nb * block
    # The mask_mod evaluates the whole layout: compiled FlexAttention calls it only inside partial
    # blocks, its eager fallback calls it everywhere (and ignores the block lists).
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=layout_mask_mod(layout, block, causal), seq_lengths=(seq_len, seq_len))


def block_mask_to_layout(block_mask) -> Tuple[torch.Tensor, int]:
    """``BlockMask`` -> ((H, NQ, NKV) int64 layout, block). Partial and full blocks both count as on;
    a batch dimension > 1 must hold one layout for every sample."""
    block_q, block_kv = block_mask.BLOCK_SIZE
    if block_q != block_kv:
        raise ValueError(f"BlockMask has block sizes ({block_q}, {block_kv}); layouts need square blocks")
    dense = block_mask.to_dense()  # (B, H, NQ, NKV)
    if dense.shape[0] > 1 and not bool((dense == dense[:1]).all()):
        raise ValueError("BlockMask differs across the batch; a layout holds one pattern per head")
    return (dense[0] != 0).to(torch.int64).cpu(), int(block_q)
