"""The fused block-sparse Triton kernels against the dense masked fp64 reference.

Without a GPU the kernels run in Triton's interpreter (~10 ms per visited tile per kernel), so the
shapes here visit ~100 tiles in total. GPU-only cases (bigger shapes, bf16 without upcast, tiles of
64/128) carry the ``gpu`` marker.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module defines its kernels

import pytest  # noqa: E402

from lightning_scale.kernels.block_sparse_attention import build_block_index, dense_reference, index_to  # noqa: E402
from lightning_scale.nn import (  # noqa: E402
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    FixedSparsityConfig,
    SparseSelfAttention,
)

launch = pytest.importorskip("lightning_scale.kernels.block_sparse_attention.launch")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not launch.triton_available(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def qkv(B, H, L, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to(DEVICE, dtype).requires_grad_() for _ in range(3)]


def run_and_compare(layout, block, tile, dtype, causal, B=1, D=16, kpm=None, bias=None, options=None):
    H, nb = layout.shape[0], layout.shape[1]
    L = nb * block
    q, k, v = qkv(B, H, L, D, dtype)
    index = index_to(build_block_index(layout, block, L, tile, causal), DEVICE)
    out = launch.triton_block_sparse_attention(q, k, v, index, key_padding_mask=kpm, bias=bias, kernel_options=options)
    ref = dense_reference(q, k, v, layout, block, causal=causal, key_padding_mask=kpm, bias=bias)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v), cot.to(dtype))
    want = torch.autograd.grad(ref, (q, k, v), cot.double())
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=tol * 4, rtol=tol * 4,
                                   msg=lambda m, name=name: f"d{name}: {m}")
    return out, got, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_per_head_layouts(dtype, causal):
    cfg = BigBirdSparsityConfig(num_heads=2, block=16, different_layout_per_head=True, num_sliding_window_blocks=1)
    run_and_compare(cfg.make_layout(64), 16, 16, dtype, causal)


def test_coarse_tiles_apply_the_fine_layout():
    # block 16, tile 32: partly-on tiles mask with the fine layout; causal diagonal inside tiles.
    cfg = FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2, attention="unidirectional")
    layout = cfg.make_layout(96)
    _, _, index = run_and_compare(layout, 16, 32, torch.float32, causal=True)
    assert int(index.col_full.sum()) < index.nnz  # some tiles really are partial
    # Programs stepping through each tile in 16-row sub-blocks (the GPU's register tiling).
    halves = {"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16)}
    run_and_compare(layout, 16, 32, torch.float16, causal=True, options=halves)
    with pytest.raises(ValueError, match="divide the tile 32"):
        run_and_compare(layout, 16, 32, torch.float32, causal=True, options={"fwd": (24, 16)})


def test_padding_mask_bias_and_bf16_upcast():
    cfg = BSLongformerSparsityConfig(num_heads=2, block=16, num_sliding_window_blocks=1, global_block_indices=[1])
    layout = cfg.make_layout(64)
    kpm = torch.zeros(2, 64, device=DEVICE)
    kpm[0, 50:] = float("-inf")
    kpm[1, 10:20] = -1.5
    bias = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    run_and_compare(layout, 16, 16, torch.float32, causal=False, B=2, kpm=kpm, bias=bias)
    run_and_compare(layout, 16, 32, torch.bfloat16, causal=True, kpm=kpm[:1])


def test_rows_with_no_blocks_and_odd_head_dim():
    layout = torch.tensor([[[1, 0, 0], [0, 0, 0], [1, 0, 1]], [[0, 1, 1], [1, 1, 0], [0, 0, 0]]])
    out, (dq, dk, dv), _ = run_and_compare(layout, 16, 32, torch.float32, causal=False, D=24)  # L=48: partial tile
    assert bool((out[0, 0, 16:32] == 0).all()) and bool((dq[0, 0, 16:32] == 0).all())
    kpm = torch.zeros(1, 48, device=DEVICE)
    kpm[0, :16] = float("-inf")  # with causal, rows 0..15 of head 0 see nothing
    out, _, _ = run_and_compare(layout, 16, 16, torch.float32, causal=True, kpm=kpm)
    assert torch.isfinite(out).all() and bool((out[0, 0, :16] == 0).all())


def test_backward_is_deterministic():
    cfg = BigBirdSparsityConfig(num_heads=1, block=16, num_sliding_window_blocks=1)
    layout = cfg.make_layout(64)
    q, k, v = qkv(1, 1, 64, 16, torch.float32)
    index = index_to(build_block_index(layout, 16, 64, 16, False), DEVICE)
    first = torch.autograd.grad(launch.triton_block_sparse_attention(q, k, v, index).sum(), (q, k, v))
    second = torch.autograd.grad(launch.triton_block_sparse_attention(q, k, v, index).sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_module_triton_backend_matches_torch_backend():
    cfg = FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2, attention="unidirectional")
    q, k, v = qkv(1, 2, 64, 16, torch.float32)
    triton_mod = SparseSelfAttention(cfg, max_seq_length=64, backend="triton")
    torch_mod = SparseSelfAttention(cfg, max_seq_length=64, backend="torch")
    torch.testing.assert_close(triton_mod(q, k, v), torch_mod(q, k, v), atol=2e-5, rtol=2e-5)
    assert len(triton_mod._indices) == 1


def test_kernel_input_errors():
    layout = torch.ones(1, 2, 2, dtype=torch.int64)
    index = build_block_index(layout, 16, 32, 16, False)
    q = torch.randn(1, 1, 32, 8, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim=8"):
        launch.triton_block_sparse_attention(q, q, q, index)
    q = torch.randn(1, 1, 32, 16, device=DEVICE, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        launch.triton_block_sparse_attention(q, q, q, index)
    with pytest.raises(ValueError, match="multiple of sparsity_config.block"):
        build_block_index(layout, 16, 32, 24, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_large_shapes(dtype, D, causal):
    cfg = BigBirdSparsityConfig(num_heads=4, block=32, different_layout_per_head=True, num_random_blocks=2)
    layout = cfg.make_layout(1024)
    kpm = torch.zeros(2, 1024, device=DEVICE)
    kpm[1, 900:] = float("-inf")
    run_and_compare(layout, 32, 64, dtype, causal, B=2, D=D, kpm=kpm)
    run_and_compare(BigBirdSparsityConfig(num_heads=4, block=128).make_layout(1024), 128, 128, dtype, causal, D=D)
