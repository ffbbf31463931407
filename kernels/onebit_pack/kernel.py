"""Triton kernels for 1-bit sign packing (same layout as ``reference.py``).

Packing fuses the sign test into the byte assembly, so a GPU reads the float buffer once and writes
1/32 of it (fp32). Each program writes ``BLOCK`` bytes of one row. Imported lazily by ``launch.py``
(only when a kernel runs), so setting ``TRITON_INTERPRET=1`` before first use is enough for CPU
tests. The kernels call no ``@triton.jit`` helpers of ``triton.language`` (``tl.sum``, ``tl.zeros``):
those stay compiled-only when triton was imported before the variable was set (Lightning imports
it), and the interpreter then refuses them.
"""

import triton
import triton.language as tl


@triton.jit
def pack_signs_kernel(x_ptr, out_ptr, length, nbytes, x_row_stride, out_row_stride,
                      IS_BOOL: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    byte = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    value = (byte * 0).to(tl.int32)  # (BLOCK,) zeros without tl.zeros (a jit helper, see below)
    # Eight strided loads OR-ed together rather than a (BLOCK, 8) tile and tl.sum: only builtins,
    # so the kernel also runs under TRITON_INTERPRET=1 when triton was imported before it was set.
    for k in tl.static_range(8):
        col = byte * 8 + k
        inside = col < length
        x = tl.load(x_ptr + row * x_row_stride + col, mask=inside, other=0)
        if IS_BOOL:
            on = x != 0
        else:
            on = x >= 0
        value = value | ((on & inside).to(tl.int32) << k)
    tl.store(out_ptr + row * out_row_stride + byte, value.to(tl.uint8), mask=byte < nbytes)


@triton.jit
def unpack_signs_kernel(packed_ptr, out_ptr, length, nbytes, packed_row_stride, out_row_stride,
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    byte = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    bit = tl.arange(0, 8)  # (8,)
    value = tl.load(packed_ptr + row * packed_row_stride + byte, mask=byte < nbytes, other=0).to(tl.int32)
    on = (value[:, None] >> bit[None, :]) & 1  # (BLOCK, 8)
    col = byte[:, None] * 8 + bit[None, :]
    tl.store(out_ptr + row * out_row_stride + col, on.to(tl.uint8), mask=col < length)
