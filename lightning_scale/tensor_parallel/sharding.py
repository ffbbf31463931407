"""How one full tensor maps to its tensor-parallel shards, and back (pure, no communication).

A :class:`ShardSpec` is attached to every parameter a plan slices (``param.tp_spec``). It is the one
description that slicing (:func:`shard_tensor`), consolidation (:func:`merge_shards`) and the grad-norm
helpers read, so a checkpoint written at tp=2 consolidates to exactly the original keys and shapes.

Two details make the layout differ from a plain ``torch.chunk``:

* **Fused sections.** A fused projection such as GPT's ``qkv`` stores ``[q | k | v]`` along the output
  dim. Each of the ``sections`` parts is split separately, so rank r holds ``[q_r | k_r | v_r]``:
  whole heads of each of q, k and v, and the attention's ``view(B, T, 3, H/tp, D)`` still works.
  The parts may differ in size (``parts``): litgpt's grouped-query ``qkv`` is ``[q | k | v]`` with
  ``n_head * hs`` q rows and ``n_query_groups * hs`` rows each of k and v; rank r then holds q heads
  ``r*H/tp ...`` and kv groups ``r*G/tp ...``, which keeps every local q head with its own kv group.
* **Replicated parts** (``splits``). Fewer kv heads than ranks (multi-query attention, ``G`` kv heads with tp a
  multiple of ``G``): the kv part is cut into ``G`` pieces only, and the ``tp / G`` consecutive ranks whose q
  heads share kv head ``g`` all hold piece ``g``. Rank r holds piece ``r * splits_k // tp`` of part k. Such rows'
  gradients are partial sums over the sharing ranks (each sees only its own q heads): the column-parallel layer
  sums them in the backward; a global norm counts them on the first sharing rank only
  (:func:`tp_counted_mask`); :func:`merge_shards` takes them from the first sharing rank.
* **Padding.** A vocabulary that tp does not divide is padded at the end to a multiple of tp. The
  padded rows live on the last rank(s), start at zero, are never looked up and are masked out of the
  loss; :func:`merge_shards` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch


@dataclass(frozen=True)
class ShardSpec:
    """``dim`` of a full tensor of length ``size`` is split over ``tp`` ranks (after padding to ``padded``)."""

    dim: int
    size: int
    tp: int
    padded: int
    sections: int = 1
    parts: Tuple[int, ...] = ()  # sizes of unequal fused sections (sum = size); () = ``sections`` equal parts
    # distinct pieces of each part (each divides tp; < tp: that part is replicated over tp // s ranks); () = tp each
    splits: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.tp < 1 or self.sections < 1:
            raise ValueError(f"ShardSpec: tp={self.tp} and sections={self.sections} must be >= 1")
        if self.splits and (not self.parts or len(self.splits) != self.sections or self.padded != self.size
                            or any(s < 1 or self.tp % s for s in self.splits)):
            raise ValueError(f"ShardSpec: splits={self.splits} need parts (one split each, dividing tp={self.tp}) "
                             "and no padding")
        if self.parts and (len(self.parts) != self.sections or sum(self.parts) != self.size
                           or any(p % s for p, s in zip(self.parts, self.part_splits))):
            raise ValueError(f"ShardSpec: parts={self.parts} must be {self.sections} sizes summing to "
                             f"size={self.size}, each a multiple of its split {self.part_splits}")
        if self.splits:
            return
        if self.padded < self.size or self.padded % (self.tp * (1 if self.parts else self.sections)):
            raise ValueError(
                f"ShardSpec: padded={self.padded} must be >= size={self.size} and a multiple of "
                f"tp*sections={self.tp * self.sections}"
            )
        if self.sections > 1 and self.padded != self.size:
            raise ValueError("ShardSpec: fused sections cannot be padded")

    @property
    def local_size(self) -> int:
        if self.splits:
            return sum(p // s for p, s in zip(self.parts, self.splits))
        return self.padded // self.tp

    @property
    def part_splits(self) -> Tuple[int, ...]:
        """Into how many distinct pieces each fused section is cut (tp for each, unless replicated)."""
        return self.splits or (self.tp,) * self.sections

    @property
    def replicated_parts(self) -> bool:
        """True when some rows are held by several ranks (a part with fewer pieces than tp)."""
        return any(s < self.tp for s in self.part_splits)

    def first_holder(self, rank: int) -> Tuple[bool, ...]:
        """Per piece of :meth:`pieces`: whether ``rank`` is the first of the ranks that hold those rows."""
        return tuple(rank % (self.tp // s) == 0 for s in self.part_splits)

    @property
    def section_local(self) -> int:
        """Rows of each fused section on one rank (equal sections only; see :meth:`pieces` for the general case)."""
        if self.parts and len(set(self.parts)) > 1:
            raise ValueError(f"ShardSpec: sections of unequal sizes {self.parts} have no single section_local")
        return self.local_size // self.sections

    @property
    def part_sizes(self) -> Tuple[int, ...]:
        """Full length of each fused section along ``dim`` (one entry when there are no sections)."""
        return self.parts or (self.size // self.sections,) * self.sections

    def pieces(self, rank: int) -> Tuple[Tuple[int, int, int], ...]:
        """``(local_start, global_start, length)`` of each contiguous run of rank's rows, in local order: one
        per fused section (section k's rows ``rank * part_k / tp ...`` of that section). Unpadded specs only."""
        if self.padded != self.size:
            raise ValueError("ShardSpec.pieces: a padded spec has a single range (local_range)")
        out, local, base = [], 0, 0
        for part, split in zip(self.part_sizes, self.part_splits):
            n = part // split
            out.append((local, base + (rank * split // self.tp) * n, n))
            local, base = local + n, base + part
        return tuple(out)

    def local_shape(self, shape) -> Tuple[int, ...]:
        """The shape of one rank's shard of a full tensor of ``shape``."""
        return tuple(self.local_size if d == self.dim else n for d, n in enumerate(shape))

    def local_range(self, rank: int) -> tuple:
        """[start, end) of rank's rows in the padded full tensor (sections == 1 only)."""
        piece = rank * self.part_splits[0] // self.tp if self.splits else rank
        return piece * self.local_size, (piece + 1) * self.local_size


def make_spec(dim: int, size: int, tp: int, *, sections: int = 1, pad: bool = False, what: str = "",
              parts: Sequence[int] = (), splits: Sequence[int] = ()) -> ShardSpec:
    """Spec for splitting ``size`` over ``tp``; raises a ValueError naming ``what`` when tp does not divide it.
    ``parts``: sizes of unequal fused sections (e.g. grouped-query ``[q | k | v]``), each split over tp.
    ``splits``: per part (``parts`` default ``(size,)``), its number of distinct pieces, a divisor of tp: fewer
    than tp replicates the part's pieces over ``tp // split`` consecutive ranks (kv heads < tp)."""
    parts = tuple(int(p) for p in parts)
    splits = tuple(int(s) for s in splits)
    if splits and any(s != tp for s in splits):
        parts = parts or (size,)
        if pad or sum(parts) != size or len(splits) != len(parts):
            raise ValueError(f"{what}: replicated parts {parts} (splits {splits}) must sum to {size}, unpadded")
        for p, s in zip(parts, splits):
            if tp % s or p % s:
                raise ValueError(f"tp={tp} does not divide {what} = {size}, and {what} part {p} cannot be "
                                 f"replicated in {s} pieces over tp={tp}")
        return ShardSpec(dim=dim, size=size, tp=tp, padded=size, sections=len(parts), parts=parts, splits=splits)
    sections = len(parts) or sections  # equal parts: the plain per-section split below
    if parts and len(set(parts)) > 1:
        if pad or sum(parts) != size:
            raise ValueError(f"{what}: fused parts {parts} must sum to {size} (and cannot be padded)")
        bad = [p for p in parts if p % tp]
        if bad:
            raise ValueError(f"tp={tp} does not divide {what} = {size} (its fused parts {parts}: {bad[0]})")
        return ShardSpec(dim=dim, size=size, tp=tp, padded=size, sections=len(parts), parts=parts)
    if size % sections:
        raise ValueError(f"{what}: size {size} is not divisible into {sections} fused sections")
    if pad:
        padded = -(-size // tp) * tp
    else:
        if (size // sections) % tp:
            part = f" (each of its {sections} fused parts has {size // sections})" if sections > 1 else ""
            raise ValueError(f"tp={tp} does not divide {what} = {size}{part}")
        padded = size
    return ShardSpec(dim=dim, size=size, tp=tp, padded=padded, sections=sections)


def mark_sharded(param: torch.Tensor, spec: ShardSpec) -> None:
    """Record on a parameter how it is split across the tp group (read by consolidation and grad norms)."""
    param.tp_spec = spec


def mark_partial_grad(param: torch.Tensor) -> None:
    """Mark a replicated parameter whose gradient on each tp rank is a partial sum (sequence parallel regions).

    :func:`~lightning_scale.tensor_parallel.grads.sync_tp_grads` all-reduces these over the tp group.
    """
    param.tp_partial_grad = True


def tp_spec(param: torch.Tensor):
    """The :class:`ShardSpec` of a tp-sharded parameter, ``None`` for a replicated one."""
    return getattr(param, "tp_spec", None)


def tp_replicated(param: torch.Tensor) -> bool:
    """True when every rank of the tp group holds the same full copy of ``param`` (LayerNorm weights,
    row-parallel biases, position embeddings...). A global gradient norm counts these once, not tp times. A
    parameter one rank holds whole and the others not at all (an expert placed by ownership,
    :mod:`~lightning_scale.tensor_parallel.expert_lists`) is not replicated."""
    return tp_spec(param) is None and not getattr(param, "tp_owned", False)


def tp_partial_grad(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tp_partial_grad", False))


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Rank's shard of ``full`` (a new contiguous tensor; meta tensors stay meta)."""
    if full.shape[spec.dim] != spec.size:
        raise ValueError(f"shard_tensor: dim {spec.dim} has {full.shape[spec.dim]} entries, spec says {spec.size}")
    if not 0 <= rank < spec.tp:
        raise ValueError(f"shard_tensor: rank {rank} outside tp={spec.tp}")
    if spec.padded != spec.size:
        start, end = spec.local_range(rank)
        pieces = []
        if start < spec.size:
            pieces.append(full.narrow(spec.dim, start, min(end, spec.size) - start))
        missing = end - max(start, spec.size)
        if missing > 0:
            shape = list(full.shape)
            shape[spec.dim] = missing
            pieces.append(full.new_zeros(shape))
        return torch.cat(pieces, dim=spec.dim).contiguous()
    pieces = [full.narrow(spec.dim, start, n) for _, start, n in spec.pieces(rank)]
    return torch.cat(pieces, dim=spec.dim).contiguous()


def merge_shards(shards: Sequence[torch.Tensor], spec: ShardSpec, dim: int = None) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor (padding dropped) from every rank's shard, in rank order.
    ``dim`` overrides ``spec.dim`` (a layer's gathered output is split along its last dim)."""
    if len(shards) != spec.tp:
        raise ValueError(f"merge_shards: got {len(shards)} shards for tp={spec.tp}")
    dim = spec.dim if dim is None else dim
    if spec.padded != spec.size:
        return torch.cat(list(shards), dim=dim).narrow(dim, 0, spec.size).contiguous()
    parts: List[torch.Tensor] = []
    for (local, _, n), split in zip(spec.pieces(0), spec.part_splits):  # section by section, rank by rank
        step = spec.tp // split  # replicated pieces: from the first rank holding each
        parts.extend(shards[r].narrow(dim, local, n) for r in range(0, spec.tp, step))
    return torch.cat(parts, dim=dim).contiguous()


def tp_counted_mask(param: torch.Tensor, rank: int, shape=None):
    """Which elements of ``param`` (this tp rank's local tensor, flattened; ``shape``: its local shape when the
    tensor itself is freed, as under ZeRO-3) a global norm counts on ``rank``: None = all of them (a sharded or
    replicated parameter is handled by :func:`tp_replicated`); else a bool tensor, False on rows of replicated
    parts that a lower rank also holds (kv heads < tp)."""
    spec = tp_spec(param)
    if spec is None or not spec.replicated_parts:
        return None
    shape = tuple(param.shape if shape is None else shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    for (local, _, n), first in zip(spec.pieces(rank), spec.first_holder(rank)):
        if first:
            mask.narrow(spec.dim, local, n).fill_(True)
    return mask.reshape(-1)
