"""Block-sparsity patterns with DeepSpeed's names, parameters, defaults and semantics.

A *layout* is a ``(num_heads, L // block, L // block)`` int64 tensor of 0/1: entry ``[h, i, j] = 1``
means that the queries of block ``i`` attend to the keys of block ``j`` in head ``h``. The configs below
reproduce DeepSpeed's ``deepspeed.ops.sparse_attention.sparsity_config`` vocabulary so existing
configurations port unchanged (see https://arxiv.org/abs/2004.05150 for Longformer,
https://arxiv.org/abs/2007.14062 for BigBird, https://arxiv.org/abs/1904.10509 for "fixed").

Differences from DeepSpeed, all deliberate:

* random blocks come from a private ``torch.Generator`` seeded with ``seed`` (a new keyword), never
  from Python's global ``random`` state, so every rank of a job builds the identical layout;
* in ``unidirectional`` mode, random blocks of ``VariableSparsityConfig`` are drawn from the causal
  range (as BigBird already does), so no sampled block is wasted on the future;
* invalid settings raise :class:`~lightning_scale.config.ConfigError` (a ``ValueError``) naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from lightning_scale.config import ConfigError

ATTENTION_MODES = ("unidirectional", "bidirectional")


def check_block(block: int) -> int:
    """Blocks must be powers of two >= 16: the kernels tile by them and DeepSpeed accepts no other."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 16 or block & (block - 1):
        raise ConfigError(f"sparsity_config.block={block!r}: must be a power of two >= 16")
    return block


def _check_positive(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"sparsity_config.{name}={value!r}: must be an integer >= {minimum}")


def _check_attention(attention: str) -> None:
    if attention not in ATTENTION_MODES:
        raise ConfigError(f"sparsity_config.attention={attention!r}: must be one of {', '.join(ATTENTION_MODES)}")


def _check_global_ranges(starts: Sequence[int], ends: Optional[Sequence[int]]) -> None:
    if any(int(i) < 0 for i in starts):
        raise ConfigError(f"sparsity_config.global_block_indices={list(starts)}: indices must be >= 0")
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ConfigError(
            f"sparsity_config.global_block_end_indices has {len(ends)} entries but global_block_indices has "
            f"{len(starts)}: they must pair up"
        )
    for start, end in zip(starts, ends):
        if start >= end:
            raise ConfigError(
                f"sparsity_config.global_block_end_indices: end {end} must be > its start index {start}"
            )


@dataclass(frozen=True)
class SparsityConfig:
    """Base: ``num_heads``, ``block`` (tokens per block) and whether heads get different layouts."""

    num_heads: int
    block: int = 16
    different_layout_per_head: bool = False

    def __post_init__(self) -> None:
        _check_positive("num_heads", self.num_heads)
        check_block(self.block)
        self._validate()

    def _validate(self) -> None:
        """Subclass checks; runs at construction so a bad config fails before any model exists."""

    @property
    def num_layout_heads(self) -> int:
        return self.num_heads if self.different_layout_per_head else 1

    @property
    def causal(self) -> bool:
        """True for unidirectional patterns: the attention module then masks the future inside blocks."""
        return getattr(self, "attention", "bidirectional") == "unidirectional"

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        if seq_len < 1 or seq_len % self.block:
            raise ConfigError(
                f"sequence length {seq_len} is not a multiple of sparsity_config.block={self.block}; "
                "pad it with lightning_scale.nn.pad_to_block_size"
            )
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """(num_heads, seq_len // block, seq_len // block) int64 0/1 tensor."""
        layout = self.setup_layout(seq_len)
        generator = torch.Generator().manual_seed(int(getattr(self, "seed", 0)))
        for h in range(self.num_layout_heads):
            self._fill_head(h, layout, generator)
        return self.check_and_propagate_first_head_layout(layout)

    def _fill_head(self, h: int, layout: torch.Tensor, generator: torch.Generator) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class DenseSparsityConfig(SparsityConfig):
    """Every block on: dense attention through the sparse machinery (useful as a parity check)."""

    def _fill_head(self, h: int, layout: torch.Tensor, generator: torch.Generator) -> None:
        layout[h] = 1


def _set_local_windows(layout: torch.Tensor, h: int, windows: Sequence[Tuple[int, int]], causal: bool) -> None:
    """Blocks ``[start, end)`` attend to each other (lower triangle only when causal)."""
    for start, end in windows:
        for row in range(start, end):
            layout[h, row, start : (row + 1 if causal else end)] = 1


def _set_global_columns(layout: torch.Tensor, h: int, start: int, end: int, causal: bool, horizontal: bool) -> None:
    """Every row attends to blocks ``[start, end)`` (rows from ``start`` on when causal); optionally
    those blocks also attend to everything (horizontal, bidirectional only)."""
    layout[h, (start if causal else 0) :, start:end] = 1
    if horizontal:
        layout[h, start:end, :] = 1


@dataclass(frozen=True)
class FixedSparsityConfig(SparsityConfig):
    """"Fixed" pattern of Child et al. (Sparse Transformers): local windows of ``num_local_blocks``
    blocks; the last ``num_global_blocks`` of each window are global (attended by every later row, or
    every row when bidirectional). With ``num_different_global_patterns > 1`` heads pick different
    global positions inside the window."""

    num_local_blocks: int = 4
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1

    def _validate(self) -> None:
        _check_positive("num_local_blocks", self.num_local_blocks)
        _check_positive("num_global_blocks", self.num_global_blocks)
        _check_positive("num_different_global_patterns", self.num_different_global_patterns)
        if self.num_local_blocks % self.num_global_blocks:
            raise ConfigError(
                f"sparsity_config.num_global_blocks={self.num_global_blocks} must divide "
                f"num_local_blocks={self.num_local_blocks}"
            )
        _check_attention(self.attention)
        if self.attention != "bidirectional" and self.horizontal_global_attention:
            raise ConfigError("sparsity_config.horizontal_global_attention=True needs attention='bidirectional'")
        if self.num_different_global_patterns > 1 and not self.different_layout_per_head:
            raise ConfigError(
                f"sparsity_config.num_different_global_patterns={self.num_different_global_patterns} needs "
                "different_layout_per_head=True"
            )
        if self.num_different_global_patterns > self.num_local_blocks // self.num_global_blocks:
            raise ConfigError(
                f"sparsity_config.num_different_global_patterns={self.num_different_global_patterns} exceeds "
                f"num_local_blocks // num_global_blocks = {self.num_local_blocks // self.num_global_blocks}"
            )

    def _fill_head(self, h: int, layout: torch.Tensor, generator: torch.Generator) -> None:
        nb, w, g = layout.shape[1], self.num_local_blocks, self.num_global_blocks
        causal = self.attention == "unidirectional"
        _set_local_windows(layout, h, [(i, min(i + w, nb)) for i in range(0, nb, w)], causal)
        first = w - (1 + h % self.num_different_global_patterns) * g  # global offset inside each window
        full_end = nb - nb % w  # end of the last complete window
        for start in range(first, full_end, w):
            _set_global_columns(layout, h, start, start + g, causal, self.horizontal_global_attention)
        if full_end < nb:  # a short last window still gets its global blocks, clamped to the end
            start = min(full_end + first, nb - g)
            _set_global_columns(layout, h, start, start + g, causal, self.horizontal_global_attention)


def _sample_random(layout: torch.Tensor, h: int, count: int, causal: bool, generator: torch.Generator) -> None:
    """``count`` distinct random key blocks per row (from the causal range when ``causal``)."""
    nb = layout.shape[1]
    if nb < count:
        raise ConfigError(
            f"sparsity_config.num_random_blocks={count} exceeds the number of blocks ({nb}) of the sequence"
        )
    if count == 0:
        return
    for row in range(nb):
        span = row + 1 if causal else nb
        cols = torch.randperm(span, generator=generator)[: min(count, span)]
        layout[h, row, cols] = 1


def _set_sliding_window(layout: torch.Tensor, h: int, window: int, causal: bool) -> None:
    nb = layout.shape[1]
    if nb < window:
        raise ConfigError(
            f"sparsity_config.num_sliding_window_blocks={window} exceeds the number of blocks ({nb}) of the sequence"
        )
    half = window // 2
    for row in range(nb):
        layout[h, row, max(0, row - half) : (row + 1 if causal else min(row + half + 1, nb))] = 1


@dataclass(frozen=True)
class VariableSparsityConfig(SparsityConfig):
    """Local windows of varying sizes (``local_window_blocks``; the last size repeats to the end),
    global blocks at ``global_block_indices`` (or ranges up to ``global_block_end_indices``) and
    ``num_random_blocks`` random blocks per row."""

    num_random_blocks: int = 0
    local_window_blocks: Tuple[int, ...] = (4,)
    global_block_indices: Tuple[int, ...] = (0,)
    global_block_end_indices: Optional[Tuple[int, ...]] = None
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        # Hydra / YAML hand in lists: store tuples so the frozen config stays hashable.
        for name in ("local_window_blocks", "global_block_indices", "global_block_end_indices"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(int(v) for v in value))
        super().__post_init__()

    def _validate(self) -> None:
        _check_positive("num_random_blocks", self.num_random_blocks, minimum=0)
        if not self.local_window_blocks or any(int(w) < 1 for w in self.local_window_blocks):
            raise ConfigError(
                f"sparsity_config.local_window_blocks={list(self.local_window_blocks)}: sizes must be >= 1")
        _check_global_ranges(self.global_block_indices, self.global_block_end_indices)
        _check_attention(self.attention)
        if self.attention != "bidirectional" and self.horizontal_global_attention:
            raise ConfigError("sparsity_config.horizontal_global_attention=True needs attention='bidirectional'")

    def _fill_head(self, h: int, layout: torch.Tensor, generator: torch.Generator) -> None:
        nb = layout.shape[1]
        causal = self.attention == "unidirectional"
        _sample_random(layout, h, self.num_random_blocks, causal, generator)
        windows, start = [], 0
        for size in self.local_window_blocks:
            windows.append((start, min(start + size, nb)))
            start += size
        last = self.local_window_blocks[-1]
        windows += [(i, min(i + last, nb)) for i in range(start, nb, last)]
        _set_local_windows(layout, h, [(s, e) for s, e in windows if s < nb], causal)
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends):
            if start < nb:
                _set_global_columns(layout, h, start, min(end, nb), causal, self.horizontal_global_attention)


@dataclass(frozen=True)
class BigBirdSparsityConfig(SparsityConfig):
    """BigBird: ``num_random_blocks`` random blocks per row, a sliding window of
    ``num_sliding_window_blocks`` and the first ``num_global_blocks`` blocks global (rows and columns)."""

    num_random_blocks: int = 1
    num_sliding_window_blocks: int = 3
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    seed: int = 0

    def _validate(self) -> None:
        _check_positive("num_random_blocks", self.num_random_blocks, minimum=0)
        _check_positive("num_sliding_window_blocks", self.num_sliding_window_blocks)
        _check_positive("num_global_blocks", self.num_global_blocks)
        _check_attention(self.attention)

    def _fill_head(self, h: int, layout: torch.Tensor, generator: torch.Generator) -> None:
        nb = layout.shape[1]
        causal = self.attention == "unidirectional"
        _sample_random(layout, h, self.num_random_blocks, causal, generator)
        _set_sliding_window(layout, h, self.num_sliding_window_blocks, causal=False)
        if nb < self.num_global_blocks:
            raise ConfigError(
                f"sparsity_config.num_global_blocks={self.num_global_blocks} exceeds the number of blocks ({nb})"
            )
        layout[h, : self.num_global_blocks, :] = 1
        layout[h, :, : self.num_global_blocks] = 1
        if causal:
            layout[h] = torch.tril(layout[h])


@dataclass(frozen=True)
class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer: a sliding window plus global blocks (rows and columns) at
    ``global_block_indices`` (or ranges ending at ``global_block_end_indices``)."""

    num_sliding_window_blocks: int = 3
    global_block_indices: Tuple[int, ...] = (0,)
    global_block_end_indices: Optional[Tuple[int, ...]] = None
    attention: str = "bidirectional"

    def __post_init__(self) -> None:
        for name in ("global_block_indices", "global_block_end_indices"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(int(v) for v in value))
        super().__post_init__()

    def _validate(self) -> None:
        _check_positive("num_sliding_window_blocks", self.num_sliding_window_blocks)
        _check_global_ranges(self.global_block_indices, self.global_block_end_indices)
        _check_attention(self.attention)

    def _fill_head(self, h: int, layout: torch.Tensor, generator: torch.Generator) -> None:
        nb = layout.shape[1]
        _set_sliding_window(layout, h, self.num_sliding_window_blocks, causal=False)
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends):
            if start < nb:
                layout[h, start : min(end, nb), :] = 1
                layout[h, :, start : min(end, nb)] = 1
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])


@dataclass(frozen=True)
class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Only a sliding window of ``num_sliding_window_blocks`` blocks (the past half of it when
    unidirectional, the default)."""

    num_sliding_window_blocks: int = 3
    attention: str = "unidirectional"

    def _validate(self) -> None:
        _check_positive("num_sliding_window_blocks", self.num_sliding_window_blocks)
        _check_attention(self.attention)

    def _fill_head(self, h: int, layout: torch.Tensor, generator: torch.Generator) -> None:
        _set_sliding_window(layout, h, self.num_sliding_window_blocks, causal=self.attention == "unidirectional")


def layout_density(layout: torch.Tensor, causal: bool = False) -> float:
    """Fraction of (query, key) pairs computed: of all pairs, or of the causal pairs when ``causal``."""
    layout = layout.bool()
    if causal:
        layout = torch.tril(layout)
        nb = layout.shape[-1]
        return float(layout.sum()) / (layout.shape[0] * nb * (nb + 1) / 2)
    return float(layout.float().mean())
