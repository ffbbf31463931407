"""Dispatch sign packing to the Triton kernel (CUDA tensors) or the vectorized torch path (CPU).

``backend="auto"`` picks Triton for CUDA tensors when Triton imports, torch otherwise;
``"triton"`` forces the kernel (CPU tensors then need ``TRITON_INTERPRET=1``, which is how the
tests compare the two); ``"torch"`` forces the reference.
"""

from __future__ import annotations

import importlib.util

import torch

from .reference import pack_signs_reference, packed_length, unpack_signs_reference

_BLOCK = 256  # bytes per program: 2048 signs
_BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(t: torch.Tensor, backend: str) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {_BACKENDS}")
    if backend == "auto":
        return t.is_cuda and triton_available()
    return backend == "triton"


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous() if t.dim() else t.reshape(1, 1)


def pack_signs(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """(..., S) float or bool -> (..., ceil(S / 8)) uint8; bit 1 where ``x >= 0`` (or True)."""
    if x.dim() == 0:
        raise ValueError("pack_signs needs a tensor with at least one dimension")
    if not (x.dtype == torch.bool or x.is_floating_point()):
        raise ValueError(f"pack_signs takes a float or bool tensor, got {x.dtype}")
    if not _use_triton(x, backend) or x.numel() == 0:
        return pack_signs_reference(x)
    from . import kernel  # lazy: see kernel.py

    rows = _rows(x)
    if rows.dtype == torch.bool:
        rows = rows.view(torch.uint8)
    length, nbytes = rows.shape[1], packed_length(rows.shape[1])
    out = torch.empty(rows.shape[0], nbytes, dtype=torch.uint8, device=x.device)
    grid = (_cdiv(nbytes, _BLOCK), rows.shape[0])
    kernel.pack_signs_kernel[grid](rows, out, length, nbytes, rows.stride(0), out.stride(0),
                                   IS_BOOL=x.dtype == torch.bool, BLOCK=_BLOCK)
    return out.reshape(*x.shape[:-1], nbytes)


def unpack_signs(packed: torch.Tensor, length: int, backend: str = "auto") -> torch.Tensor:
    """(..., Sb) uint8 -> (..., length) bool; the inverse of :func:`pack_signs` on the first ``length``."""
    if packed.dim() == 0:
        raise ValueError("unpack_signs needs a tensor with at least one dimension")
    if not _use_triton(packed, backend) or packed.numel() == 0:
        return unpack_signs_reference(packed, length)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed signs must be uint8, got {packed.dtype}")
    if not 0 <= length <= 8 * packed.shape[-1]:
        raise ValueError(f"length={length} does not fit in {packed.shape[-1]} packed bytes")
    from . import kernel

    rows = _rows(packed)
    out = torch.empty(rows.shape[0], length, dtype=torch.uint8, device=packed.device)
    grid = (_cdiv(rows.shape[1], _BLOCK), rows.shape[0])
    kernel.unpack_signs_kernel[grid](rows, out, length, rows.shape[1], rows.stride(0), out.stride(0),
                                     BLOCK=_BLOCK)
    return out.view(torch.bool).reshape(*packed.shape[:-1], length)


def _cdiv(a: int, b: int) -> int:
    return max(1, -(-a // b))
