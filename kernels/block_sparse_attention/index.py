"""Per-row and per-column index lists of a block layout, at the kernels' tile granularity.

The fused kernels never read the layout matrix to decide what to visit: the query program of tile
``m`` of head ``h`` walks ``col_idx[row_ptr[h, m]:row_ptr[h, m + 1]]`` (the key tiles it attends to)
and the key program of tile ``n`` walks ``row_idx[col_ptr[h, n]:col_ptr[h, n + 1]]`` (the query tiles
that attend to it), so work is proportional to the number of non-zero tiles. When the kernel tile is
larger than the layout block (GPU tiles are >= 64 for tensor-core efficiency), the tile layout is the
OR of the fine blocks inside it, and ``*_full`` flags tell whether the fine layout must be applied
as an element mask inside that tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockIndex:
    block: int  # fine layout block (tokens)
    tile: int  # kernel tile (tokens), a multiple of block
    seq_len: int
    num_tiles: int
    causal: bool
    fine_layout: torch.Tensor  # (H, NB, NB) int8, causal lower triangle applied
    row_ptr: torch.Tensor  # (H * num_tiles + 1,) int32 into col_idx, heads concatenated
    col_idx: torch.Tensor  # (nnz,) int32 key tile ids
    col_full: torch.Tensor  # (nnz,) int8: 1 if every fine block of that tile is on
    col_ptr: torch.Tensor  # (H * num_tiles + 1,) int32 into row_idx
    row_idx: torch.Tensor  # (nnz,) int32 query tile ids
    row_full: torch.Tensor  # (nnz,) int8

    @property
    def nnz(self) -> int:
        return int(self.col_idx.numel())

    @property
    def num_heads(self) -> int:
        return int(self.fine_layout.shape[0])


def causal_layout(layout: torch.Tensor, causal: bool) -> torch.Tensor:
    """Boolean layout with the blocks above the diagonal removed when ``causal``."""
    layout = layout.bool()
    return torch.tril(layout) if causal else layout


def _csr(tile_layout: torch.Tensor, full: torch.Tensor):
    """(H, T, T) bool -> (ptr (H*T+1,), idx (nnz,), full (nnz,)); row-major so idx is ascending per row."""
    heads, tiles, _ = tile_layout.shape
    h, r, c = tile_layout.nonzero(as_tuple=True)
    counts = torch.bincount(h * tiles + r, minlength=heads * tiles)
    ptr = torch.zeros(heads * tiles + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(counts, 0)
    return ptr.to(torch.int32), c.to(torch.int32), full[h, r, c].to(torch.int8)


def build_block_index(layout: torch.Tensor, block: int, seq_len: int, tile: int, causal: bool) -> BlockIndex:
    """Index lists for ``layout`` (H, seq_len // block, seq_len // block) with kernel tiles of ``tile`` tokens.

    Built on the CPU once per (layout, L, tile, causal) and moved to the device by the caller (cached).
    """
    if tile % block:
        raise ValueError(f"kernel tile {tile} must be a multiple of sparsity_config.block={block}")
    fine = causal_layout(layout, causal)  # (H, NB, NB)
    heads, nb, _ = fine.shape
    if nb * block != seq_len:
        raise ValueError(f"layout has {nb} blocks of {block} but the sequence has {seq_len} tokens")
    factor = tile // block
    num_tiles = -(-seq_len // tile)
    padded = torch.zeros(heads, num_tiles * factor, num_tiles * factor, dtype=torch.bool)
    padded[:, :nb, :nb] = fine
    # Blocks past the sequence end count as "on" for fullness: bounds masks already drop them.
    outside = torch.ones_like(padded)
    outside[:, :nb, :nb] = False
    tiles = padded.view(heads, num_tiles, factor, num_tiles, factor)
    any_on = tiles.any(dim=4).any(dim=2)  # (H, T, T)
    all_on = (tiles | outside.view_as(tiles)).all(dim=4).all(dim=2)
    row_ptr, col_idx, col_full = _csr(any_on, all_on)
    col_ptr, row_idx, row_full = _csr(any_on.transpose(1, 2), all_on.transpose(1, 2))
    return BlockIndex(
        block=block, tile=tile, seq_len=seq_len, num_tiles=num_tiles, causal=causal,
        fine_layout=fine.to(torch.int8).contiguous(), row_ptr=row_ptr, col_idx=col_idx, col_full=col_full,
        col_ptr=col_ptr, row_idx=row_idx, row_full=row_full,
    )


def index_to(index: BlockIndex, device: torch.device) -> BlockIndex:
    """The same index with every tensor on ``device``."""
    moved = {name: getattr(index, name).to(device) for name in
             ("fine_layout", "row_ptr", "col_idx", "col_full", "col_ptr", "row_idx", "row_full")}
    return BlockIndex(block=index.block, tile=index.tile, seq_len=index.seq_len, num_tiles=index.num_tiles,
                      causal=index.causal, **moved)
