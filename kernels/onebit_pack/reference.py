"""Vectorized torch sign packing: the CPU path, and the reference the Triton kernel is tested against.

Layout (shared with ``kernel.py``): along the last dimension, element ``8 * b + k`` is bit ``k``
(least significant first) of byte ``b``. A row of ``S`` signs takes ``ceil(S / 8)`` bytes; the
bits past ``S`` in the last byte are zero. Bit 1 means "x >= 0" (or ``True`` for a bool input), so
``+0.0`` and ``-0.0`` both pack as 1: a 1-bit code has no zero, and the caller's error feedback
carries the difference.
"""

from __future__ import annotations

import sys

import torch


def packed_length(length: int) -> int:
    """Bytes that hold ``length`` signs."""
    return (length + 7) // 8


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.bool else x >= 0


# Multiplying 8 bytes of 0/1 (byte k = bit 8k of a little-endian int64) by sum_{j=1..8} 2^(7j) moves
# byte k's bit to bit 56 + k, and no two partial products share a bit position (so no carries):
# bits 56..63 of the product are the 8 signs, least significant first. One multiply per 8 signs
# instead of a shift and a reduction over a dimension of 8, which torch runs slowly.
_GATHER_BITS = 0x0102040810204080


def pack_signs_reference(x: torch.Tensor) -> torch.Tensor:
    """(..., S) float or bool -> (..., ceil(S / 8)) uint8."""
    bits = _bits(x)
    lead, length = bits.shape[:-1], bits.shape[-1]
    nbytes = packed_length(length)
    if length % 8 or not bits.is_contiguous() or bits.storage_offset() % 8:
        padded = torch.zeros(*lead, 8 * nbytes, dtype=torch.uint8, device=bits.device)
        padded[..., :length] = bits
        bits = padded
    groups = bits.view(torch.uint8).reshape(*lead, nbytes, 8)  # (..., Sb, 8)
    if sys.byteorder != "little":  # the multiply trick reads byte k as bits 8k..8k+7
        shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
        return (groups << shifts).sum(dim=-1, dtype=torch.uint8)
    words = groups.view(torch.int64).squeeze(-1)  # (..., Sb)
    # int64 products wrap modulo 2**64; the top byte holds the packed signs.
    return ((words * _GATHER_BITS) >> 56).to(torch.uint8)


def unpack_signs_reference(packed: torch.Tensor, length: int) -> torch.Tensor:
    """(..., Sb) uint8 -> (..., length) bool, with ``length <= 8 * Sb``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed signs must be uint8, got {packed.dtype}")
    if not 0 <= length <= 8 * packed.shape[-1]:
        raise ValueError(f"length={length} does not fit in {packed.shape[-1]} packed bytes")
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # (..., Sb, 8)
    return bits.view(torch.bool).reshape(*packed.shape[:-1], -1)[..., :length]  # 0/1 bytes are valid bools
