"""The Triton sign-packing kernels against the torch reference (TRITON_INTERPRET=1 without a GPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module imports triton

import pytest  # noqa: E402

from lightning_scale.kernels.onebit_pack import (  # noqa: E402
    pack_signs, pack_signs_reference, packed_length, triton_available, unpack_signs, unpack_signs_reference,
)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Around the byte and the program-block (256 bytes = 2048 signs) boundaries.
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 2047, 2048, 2049, 4100]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_pack_kernel_matches_reference(length, dtype):
    g = torch.Generator().manual_seed(length)
    x = torch.randn(3, length, generator=g, dtype=torch.float64)
    x[:, ::5] = 0.0  # sign(0) packs as 1
    x[:, 1::7] = -0.0
    x = (x >= 0) if dtype == torch.bool else x.to(dtype)
    x = x.to(DEVICE)
    packed = pack_signs(x, backend="triton")
    assert packed.shape == (3, packed_length(length)) and packed.dtype == torch.uint8
    assert torch.equal(packed.cpu(), pack_signs_reference(x.cpu()))
    bits = unpack_signs(packed, length, backend="triton")
    assert torch.equal(bits.cpu(), unpack_signs_reference(packed.cpu(), length))
    assert torch.equal(bits.cpu(), (x >= 0).cpu() if dtype != torch.bool else x.cpu())


def test_kernel_handles_leading_dims_and_strided_input():
    x = torch.randn(2, 3, 40, device=DEVICE)[:, :, ::2]  # (2, 3, 20), non-contiguous
    assert torch.equal(pack_signs(x, backend="triton").cpu(), pack_signs_reference(x.cpu()))
    assert pack_signs(x, backend="triton").shape == (2, 3, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_backend_on_gpu_large():
    x = torch.randn(4, 3_000_001, device="cuda")
    packed = pack_signs(x)
    assert torch.equal(packed.cpu(), pack_signs_reference(x.cpu()))
    assert torch.equal(unpack_signs(packed, x.shape[1]).cpu(), (x >= 0).cpu())
