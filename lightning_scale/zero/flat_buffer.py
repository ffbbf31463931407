"""Flat-buffer layout for ZeRO: parameters grouped into buckets, each bucket sharded over N ranks.

Pure bookkeeping, no communication. Each bucket holds parameters of one optimizer param group and one
dtype, in reverse registration order (roughly the order their gradients appear in backward), and is
padded to a multiple of N elements. Rank r owns elements ``[r * S, (r + 1) * S)`` of every bucket
(``S = padded / N``), so a per-bucket reduce-scatter hands each rank exactly its slice and a
per-bucket all-gather rebuilds the full parameters. The concatenation of a rank's slices is its
shard of the model; optimizers that act element-wise (Adam, AdamW, SGD, Adagrad, ...) see it as
ordinary tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass
class ParamSlot:
    """Where one parameter lives inside its bucket."""

    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size

    def shard_overlap(self, shard_start: int, shard_end: int) -> Tuple[int, int]:
        """Range ``[lo, hi)`` of this parameter's flat elements that fall in the shard (may be empty)."""
        lo = max(self.offset, shard_start) - self.offset
        hi = min(self.offset + self.numel, shard_end) - self.offset
        return (lo, max(lo, hi))


@dataclass
class Bucket:
    index: int
    group_index: int
    dtype: torch.dtype
    slots: List[ParamSlot] = field(default_factory=list)
    numel: int = 0  # unpadded
    padded_numel: int = 0
    world_size: int = 1

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> Tuple[int, int]:
        s = self.shard_numel
        return rank * s, (rank + 1) * s

    @property
    def params(self) -> List[torch.nn.Parameter]:
        return [s.param for s in self.slots]


def _pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_buckets(param_groups: Sequence[Sequence[torch.nn.Parameter]], bucket_numel: int,
                  world_size: int, align: int = 1, first_bucket_numel: Optional[int] = None) -> List[Bucket]:
    """Split each group's trainable params (reverse order) into buckets of about ``bucket_numel``.

    A parameter larger than ``bucket_numel`` gets a bucket of its own. ``align`` pads each bucket so its
    shard size is a multiple of ``align`` elements (useful for vectorized kernels). ``first_bucket_numel``: a
    smaller cap for the very first bucket (DDP's trick: the first gradients of backward are reduced at once,
    overlapping the rest of backward, instead of waiting for a full bucket).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel} must be >= 1")
    buckets: List[Bucket] = []

    def close(b: Bucket) -> None:
        b.padded_numel = _pad_to(max(b.numel, 1), world_size * align)
        buckets.append(b)

    for gi, params in enumerate(param_groups):
        current = None
        for p in reversed(list(params)):
            cap = first_bucket_numel if (first_bucket_numel and not buckets) else bucket_numel
            if current is not None and (current.dtype != p.dtype or current.numel + p.numel() > cap):
                close(current)
                current = None
            if current is None:
                current = Bucket(index=len(buckets), group_index=gi, dtype=p.dtype, world_size=world_size)
            current.slots.append(ParamSlot(p, current.numel, p.numel(), p.shape))
            current.numel += p.numel()
        if current is not None:
            close(current)
    for i, b in enumerate(buckets):
        b.index = i
    return buckets
