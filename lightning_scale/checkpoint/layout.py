"""The layout-free piece model: what a rank owns, described in the coordinates of the *original* tensors.

A checkpoint written this way knows nothing of the layout that wrote it. Each rank describes what it holds as
:class:`Piece` objects::

    Piece(key="model/blocks.0.attn.qkv.weight", global_shape=(96, 32), dtype=float32,
          chunks=[Chunk(offsets=(10, 7), sizes=(1, 25)), Chunk((11, 0), (40, 32)), ...],
          tensors=[<local view (1, 25)>, <local view (40, 32)>, ...])

``global_shape`` is the shape of the parameter (or optimizer state) in the unsplit model with its true vocabulary
size; every chunk is a rectangle ``[offsets, offsets + sizes)`` of it and ``tensors[i]`` is the rank's local view
holding that rectangle (a view into the flat ZeRO buffer, the tp slice, ...: saving reads them, loading writes them
in place). The layouts map onto this as follows:

- **ZeRO flat shard**: a rank holds a contiguous flat range ``[start, end)`` of a parameter in row-major order.
  :func:`flat_range_to_chunks` cuts it into at most ``2 * (ndim - 1) + 1`` rectangles, each contiguous in the
  flat range (so each local view is a plain ``flat[a:b].view(sizes)``).
- **tensor-parallel slice**: the rank's tensor is a rectangle of the global one along one dim (``TPSlice``); a flat
  range then lives in the *local slice's* row-major order: the chunks are computed on the local shape, then shifted
  by the slice offset along the split dim.
- **vocabulary padding**: rows past the true size along the padded dim are dropped on save (the chunks are clipped)
  and zero-filled on load (``Piece.padding`` holds the local views of the dropped rows).
- **pipeline stages** own disjoint fqns: nothing to map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    """A rectangle ``[offsets, offsets + sizes)`` of a global tensor."""

    offsets: Shape
    sizes: Shape

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def shifted(self, dim: int, by: int) -> "Chunk":
        offsets = list(self.offsets)
        offsets[dim] += by
        return Chunk(tuple(offsets), self.sizes)


@dataclass(frozen=True)
class TPSlice:
    """A rank's tensor is ``global[..., offset:offset + size, ...]`` along ``dim`` (``size`` = local shape[dim])."""

    dim: int
    offset: int


@dataclass
class Piece:
    """What one rank holds of one checkpoint key: chunks of the global tensor and the local views holding them."""

    key: str
    global_shape: Shape
    dtype: torch.dtype
    chunks: List[Chunk] = field(default_factory=list)
    tensors: List[torch.Tensor] = field(default_factory=list)
    padding: List[torch.Tensor] = field(default_factory=list)  # local views past the true size (load: zeroed)

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        if len(self.chunks) != len(self.tensors):
            raise ValueError(f"{self.key}: {len(self.chunks)} chunks but {len(self.tensors)} tensors")
        for c, t in zip(self.chunks, self.tensors):
            if tuple(t.shape) != tuple(c.sizes):
                raise ValueError(f"{self.key}: chunk {c} is held by a tensor of shape {tuple(t.shape)}")
            if any(o < 0 or o + s > g for o, s, g in zip(c.offsets, c.sizes, self.global_shape)) \
                    or len(c.offsets) != len(self.global_shape):
                raise ValueError(f"{self.key}: chunk {c} is outside the global shape {self.global_shape}")

    @property
    def numel(self) -> int:
        return sum(c.numel for c in self.chunks)

    def zero_padding_(self) -> None:
        for t in self.padding:
            t.zero_()


# ----------------------------------------------------------------------------------------------- geometry
def flat_range_to_chunks(shape: Sequence[int], start: int, end: int) -> List[Tuple[Chunk, int]]:
    """Cut the row-major flat range ``[start, end)`` of a tensor of ``shape`` into rectangles.

    Returns ``(chunk, flat_offset)`` pairs in flat order, ``flat_offset`` being where the chunk's first element sits
    relative to ``start``; each chunk is contiguous in the flat order. At most ``2 * (ndim - 1) + 1`` chunks: a
    partial head at every level going in, one block of whole rows, a partial tail at every level going out.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of shape {shape} ({total} elements)")
    out, pos = [], 0
    for offsets, sizes in _rects(shape, start, end):
        chunk = Chunk(offsets, sizes)
        out.append((chunk, pos))
        pos += chunk.numel
    return out


def _rects(shape: Shape, start: int, end: int) -> Iterator[Tuple[Shape, Shape]]:
    if start >= end:
        return
    if len(shape) == 0:  # a scalar: its only element
        yield (), ()
        return
    if len(shape) == 1:
        yield (start,), (end - start,)
        return
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    if r0 == r1:  # inside one row of dim 0
        for off, sz in _rects(shape[1:], c0, c1):
            yield (r0,) + off, (1,) + sz
        return
    if c0:  # the head: the end of row r0
        for off, sz in _rects(shape[1:], c0, inner):
            yield (r0,) + off, (1,) + sz
        r0 += 1
    if r1 > r0:  # whole rows
        yield (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:]
    if c1:  # the tail: the start of row r1
        for off, sz in _rects(shape[1:], 0, c1):
            yield (r1,) + off, (1,) + sz


def _clip(chunk: Chunk, dim: int, limit: int) -> Tuple[Optional[Chunk], int]:
    """The part of ``chunk`` below ``limit`` along ``dim`` and how many of its rows that keeps."""
    keep = max(0, min(chunk.sizes[dim], limit - chunk.offsets[dim]))
    if keep == 0:
        return None, 0
    sizes = list(chunk.sizes)
    sizes[dim] = keep
    return Chunk(chunk.offsets, tuple(sizes)), keep


def _add(piece_chunks, piece_tensors, padding, chunk: Chunk, view: torch.Tensor, true_shape: Shape,
         pad_dim: Optional[int]) -> None:
    if pad_dim is None:
        piece_chunks.append(chunk)
        piece_tensors.append(view)
        return
    kept, rows = _clip(chunk, pad_dim, true_shape[pad_dim])
    if rows < chunk.sizes[pad_dim]:
        padding.append(view.narrow(pad_dim, rows, chunk.sizes[pad_dim] - rows))
    if kept is not None:
        piece_chunks.append(kept)
        piece_tensors.append(view.narrow(pad_dim, 0, rows))


def _padded_global(local_shape: Shape, tp: Optional[TPSlice], padded_global: Optional[Sequence[int]]) -> Shape:
    if padded_global is not None:
        return tuple(int(s) for s in padded_global)
    if tp is not None:
        raise ValueError("a tensor-parallel piece needs the (padded) global shape")
    return local_shape


def _pad_dim(padded: Shape, true_shape: Shape) -> Optional[int]:
    if len(padded) != len(true_shape):
        raise ValueError(f"true shape {true_shape} and padded shape {padded} differ in rank")
    diff = [d for d, (p, t) in enumerate(zip(padded, true_shape)) if p != t]
    if not diff:
        return None
    if len(diff) > 1 or padded[diff[0]] < true_shape[diff[0]]:
        raise ValueError(f"padded shape {padded} must exceed the true shape {true_shape} along one dim")
    return diff[0]


# ----------------------------------------------------------------------------------------------- builders
def tensor_piece(key: str, tensor: torch.Tensor, *, tp: Optional[TPSlice] = None,
                 global_shape: Optional[Sequence[int]] = None, true_shape: Optional[Sequence[int]] = None) -> Piece:
    """A rank holding a whole local tensor: the full tensor (``tp=None``) or a tp slice of a ``global_shape`` tensor
    (padded shape when vocabulary-padded; ``true_shape`` then names the shape the checkpoint stores)."""
    local = tuple(tensor.shape)
    padded = _padded_global(local, tp, global_shape)
    true = tuple(true_shape) if true_shape is not None else padded
    pad_dim = _pad_dim(padded, true)
    chunk = Chunk((0,) * len(local), local)
    if tp is not None:
        chunk = chunk.shifted(tp.dim, tp.offset)
    chunks: List[Chunk] = []
    views: List[torch.Tensor] = []
    padding: List[torch.Tensor] = []
    if tensor.numel():
        _add(chunks, views, padding, chunk, tensor, true, pad_dim)
    return Piece(key, true, tensor.dtype, chunks, views, padding)


def flat_piece(key: str, flat: torch.Tensor, local_shape: Sequence[int], start: int, *,
               tp: Optional[TPSlice] = None, global_shape: Optional[Sequence[int]] = None,
               true_shape: Optional[Sequence[int]] = None) -> Piece:
    """A rank holding ``flat`` (1-D) = elements ``[start, start + len(flat))`` of a tensor of ``local_shape`` in its
    row-major order (a ZeRO flat shard); that tensor is the whole parameter or a tp slice of ``global_shape``."""
    local = tuple(int(s) for s in local_shape)
    if flat.dim() != 1:
        raise ValueError(f"{key}: a flat shard must be 1-D, got shape {tuple(flat.shape)}")
    padded = _padded_global(local, tp, global_shape)
    true = tuple(true_shape) if true_shape is not None else padded
    pad_dim = _pad_dim(padded, true)
    chunks: List[Chunk] = []
    views: List[torch.Tensor] = []
    padding: List[torch.Tensor] = []
    for chunk, pos in flat_range_to_chunks(local, start, start + flat.numel()):
        view = flat[pos:pos + chunk.numel].view(chunk.sizes)  # contiguous in the flat order: a plain view
        if tp is not None:
            chunk = chunk.shifted(tp.dim, tp.offset)
        _add(chunks, views, padding, chunk, view, true, pad_dim)
    return Piece(key, true, flat.dtype, chunks, views, padding)


def chunks_mask(shape: Sequence[int], chunks: Sequence[Chunk]) -> torch.Tensor:
    """Reference: a bool tensor of ``shape`` that is True where the chunks lie (tests and coverage checks)."""
    mask = torch.zeros(tuple(shape), dtype=torch.bool)
    for c in chunks:
        mask[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = True
    return mask


def model_key(fqn: str) -> str:
    return f"model/{fqn}"


def optim_key(fqn: str, state: str) -> str:
    return f"optim/{fqn}/{state}"


def master_key(fqn: str) -> str:
    return f"master/{fqn}"
