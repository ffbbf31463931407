"""1-bit sign packing (8 signs per byte): a Triton kernel for GPUs and a vectorized torch path.

Used by :mod:`lightning_scale.comm.compressed` (1-bit Adam). Installed as
``lightning_scale.kernels.onebit_pack``; the Triton module is imported only when a kernel runs.
"""

from .launch import pack_signs, triton_available, unpack_signs
from .reference import pack_signs_reference, packed_length, unpack_signs_reference

__all__ = [
    "pack_signs",
    "pack_signs_reference",
    "packed_length",
    "triton_available",
    "unpack_signs",
    "unpack_signs_reference",
]
