"""The CPU (block-gather) engine and SparseSelfAttention against the dense masked fp64 reference."""

import math

import pytest
import torch

from lightning_scale.config import ConfigError
from lightning_scale.kernels.block_sparse_attention import dense_reference
from lightning_scale.nn import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    block_sparse_attention,
)
from lightning_scale.nn.block_gather import block_gather_attention, build_gather_plan


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes: a second intra-op thread only adds synchronisation (badly so on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def qkv(B, H, L, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3)]


def grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    return torch.autograd.grad(out, inputs, cot.to(out.dtype))


def check_against_reference(out, q, k, v, layout, block, atol, **masks):
    ref = dense_reference(q, k, v, layout, block, **masks)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
    for got, want in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=0)


CASES = {
    "bigbird-per-head-bidirectional": (BigBirdSparsityConfig(3, 16, different_layout_per_head=True), False),
    "fixed-causal": (FixedSparsityConfig(3, 16, attention="unidirectional", num_local_blocks=2), True),
    "longformer-bidirectional-block32": (BSLongformerSparsityConfig(3, 32, global_block_indices=[1]), False),
    "variable-random-causal": (VariableSparsityConfig(3, 16, num_random_blocks=2, different_layout_per_head=True,
                                                      attention="unidirectional"), True),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 24])  # one row per chunk / everything in one chunk
def test_cpu_engine_matches_reference_fp32(name, chunk_bytes):
    cfg, causal = CASES[name]
    B, H, L, D = 2, 3, 128, 16
    layout = cfg.make_layout(L)
    q, k, v = qkv(B, H, L, D)
    plan = build_gather_plan(layout, cfg.block, B, D, causal, chunk_bytes=chunk_bytes)
    out = block_gather_attention(q, k, v, plan, scale=D**-0.5)
    check_against_reference(out, q, k, v, layout, cfg.block, atol=1e-6, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_engine_masks_bias_and_empty_rows(causal):
    B, H, L, D, block = 2, 2, 96, 16, 16
    layout = BigBirdSparsityConfig(H, block, different_layout_per_head=True).make_layout(L)
    layout[1, 3] = 0  # a query block row with no key block at all
    q, k, v = qkv(B, H, L, D)
    kpm = torch.zeros(B, L)
    kpm[0, 70:] = float("-inf")  # padding
    kpm[1, :16] = float("-inf")  # with causal, the first query rows of sample 1 see nothing
    kpm[1, 20:30] = -2.0  # additive values, not only -inf
    bias = torch.randn(1, H, L, L, generator=torch.Generator().manual_seed(3))
    plan = build_gather_plan(layout, block, B, D, causal, chunk_bytes=1 << 14)
    out = block_gather_attention(q, k, v, plan, key_padding_mask=kpm, bias=bias, scale=D**-0.5)
    assert bool((out[:, 1, 48:64] == 0).all())  # the empty row gives zeros
    check_against_reference(out, q, k, v, layout, block, atol=1e-6, causal=causal, key_padding_mask=kpm, bias=bias)


def test_cpu_engine_gradcheck_fp64():
    B, H, L, D, block = 1, 2, 48, 2, 16
    layout = torch.tensor([[[1, 0, 0], [1, 1, 0], [0, 1, 1]], [[0, 1, 0], [1, 0, 1], [1, 1, 1]]])
    q, k, v = qkv(B, H, L, D, dtype=torch.float64)
    kpm = torch.zeros(B, L, dtype=torch.float64)
    kpm[0, 44:] = float("-inf")
    bias = torch.randn(H, L, L, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for causal in (False, True):
        plan = build_gather_plan(layout, block, B, D, causal, chunk_bytes=1)

        def fn(q, k, v, plan=plan):
            return block_gather_attention(q, k, v, plan, key_padding_mask=kpm, bias=bias, scale=0.7)

        assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


def test_module_masks_modes_and_rpe():
    B, H, L, D = 2, 2, 64, 16
    cfg = BSLongformerSparsityConfig(H, 16, num_sliding_window_blocks=1)
    q, k, v = qkv(B, H, L, D)
    keep = torch.ones(B, L)
    keep[1, 50:] = 0
    attn_keep = torch.ones(L, L)
    attn_keep[5, :10] = 0
    rpe = torch.randn(H, L, L, generator=torch.Generator().manual_seed(2))
    mod = SparseSelfAttention(cfg, key_padding_mask_mode="mul", attn_mask_mode="mul", max_seq_length=128)
    out = mod(q, k, v, rpe=rpe, key_padding_mask=keep, attn_mask=attn_keep)
    kpm = torch.zeros(B, L).masked_fill(keep == 0, float("-inf"))
    bias = torch.zeros(L, L).masked_fill(attn_keep == 0, float("-inf")) + rpe
    check_against_reference(out, q, k, v, cfg.make_layout(128)[:, :4, :4], 16, atol=1e-6, key_padding_mask=kpm,
                            bias=bias)
    add = SparseSelfAttention(cfg, key_padding_mask_mode="add", attn_mask_mode="add", max_seq_length=128)
    torch.testing.assert_close(add(q, k, v, rpe=rpe, key_padding_mask=kpm, attn_mask=bias - rpe), out)


def test_module_auto_pad_and_causal_default():
    B, H, L, D = 1, 2, 50, 16
    cfg = FixedSparsityConfig(H, 16, attention="unidirectional")
    q, k, v = qkv(B, H, L, D)
    mod = SparseSelfAttention(cfg, max_seq_length=64, auto_pad=True)
    assert mod.causal  # unidirectional config -> causal
    out = mod(q, k, v)
    assert out.shape == (B, H, L, D)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 14))  # noqa: E731
    ref = dense_reference(pad(q), pad(k), pad(v), cfg.make_layout(64), 16, causal=True)[:, :, :L]
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)
    bi = SparseSelfAttention(FixedSparsityConfig(H, 16), max_seq_length=64, auto_pad=True)
    kpm = torch.zeros(B, 64)
    kpm[:, L:] = float("-inf")  # auto_pad masks the padded keys of a bidirectional pattern
    ref = dense_reference(pad(q), pad(k), pad(v), FixedSparsityConfig(H, 16).make_layout(64), 16,
                          key_padding_mask=kpm)[:, :, :L]
    torch.testing.assert_close(bi(q, k, v).double(), ref, atol=1e-6, rtol=0)


def test_half_inputs_on_cpu_and_functional_form():
    B, H, L, D = 1, 2, 64, 16
    layout = BigBirdSparsityConfig(H, 16).make_layout(L)
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = qkv(B, H, L, D, dtype=dtype)
        out = block_sparse_attention(q, k, v, layout, 16)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), dense_reference(q, k, v, layout, 16), atol=2e-2, rtol=0)
    q, k, v = qkv(B, H, L, D, dtype=torch.float64)
    out = block_sparse_attention(q, k, v, layout, 16, causal=True, scale=0.5)
    torch.testing.assert_close(out, dense_reference(q, k, v, layout, 16, causal=True, scale=0.5), atol=1e-12, rtol=0)


def test_backward_inside_autocast_float16():
    """The pipeline runtime runs a micro-batch's backward inside the autocast context of precision=fp16: the backward's
    matmuls then make half tensors, which the float32 gradient accumulators took as an error (index_add_: self Float,
    source Half; seen in the Hydra app with strategy=pipeline precision=fp16 attention=fixed)."""
    B, H, L, D = 1, 2, 64, 16
    layout = FixedSparsityConfig(H, 16).make_layout(L)
    plan = build_gather_plan(layout, 16, B, D, False)
    q, k, v = qkv(B, H, L, D)
    with torch.autocast("cpu", dtype=torch.float16):
        out = block_gather_attention(q, k, v, plan, scale=D**-0.5)
        out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in (q, k, v))
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    block_gather_attention(*ref, plan, scale=D**-0.5).sum().backward()
    for t, r in zip((q, k, v), ref):
        torch.testing.assert_close(t.grad, r.grad, atol=5e-2, rtol=5e-2)


def test_dense_config_equals_sdpa():
    q, k, v = qkv(2, 2, 64, 16)
    for causal in (False, True):
        out = SparseSelfAttention(DenseSparsityConfig(2, 16), max_seq_length=64, causal=causal)(q, k, v)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_bad_input_raises_clear_errors():
    cfg = FixedSparsityConfig(num_heads=2, block=16)
    mod = SparseSelfAttention(cfg, max_seq_length=128)
    with pytest.raises(ValueError, match="not a multiple of sparsity_config.block=16"):
        mod(*qkv(1, 2, 40, 16))
    with pytest.raises(ValueError, match="sparsity_config.num_heads=2"):
        mod(*qkv(1, 3, 64, 16))
    with pytest.raises(ValueError, match="exceeds max_seq_length=128"):
        mod(*qkv(1, 2, 256, 16))
    with pytest.raises(ValueError, match="share one"):
        q, k, v = qkv(1, 2, 64, 16)
        mod(q, k[:, :, :32], v)
    with pytest.raises(ConfigError, match="key_padding_mask_mode='xor'"):
        SparseSelfAttention(cfg, key_padding_mask_mode="xor")
    with pytest.raises(ConfigError, match="attn_mask_mode='none'"):
        SparseSelfAttention(cfg, attn_mask_mode="none")
    with pytest.raises(ConfigError, match="backend='cuda'"):
        SparseSelfAttention(cfg, backend="cuda")
    with pytest.raises(ConfigError, match="max_seq_length=100"):
        SparseSelfAttention(cfg, max_seq_length=100)
    with pytest.raises(ValueError, match="key_padding_mask covers 32 keys"):
        mod(*qkv(1, 2, 64, 16), key_padding_mask=torch.ones(1, 32))


def test_plans_are_cached_per_shape():
    mod = SparseSelfAttention(BigBirdSparsityConfig(2, 16), max_seq_length=128)
    q, k, v = qkv(1, 2, 64, 16)
    mod(q, k, v)
    mod(q, k, v)
    assert len(mod._plans) == 1
    mod(*qkv(1, 2, 128, 16))
    assert len(mod._plans) == 2
    with torch.no_grad():
        assert math.isfinite(float(mod(q, k, v).sum()))


def test_parallel_workers_match_reference_and_are_deterministic():
    torch.set_num_threads(2)  # two chunk workers (the fixture restores the thread count)
    cfg = BigBirdSparsityConfig(2, 16, different_layout_per_head=True, num_random_blocks=2)
    B, H, L, D = 2, 2, 128, 16
    layout = cfg.make_layout(L)
    q, k, v = qkv(B, H, L, D)
    plan = build_gather_plan(layout, 16, B, D, False, chunk_bytes=1 << 12, workers=2)
    assert len(plan.shares) == 2 and len(plan.chunks) > 4
    out = block_gather_attention(q, k, v, plan, scale=D**-0.5)
    check_against_reference(out, q, k, v, layout, 16, atol=1e-6)
    first = grads(block_gather_attention(q, k, v, plan, scale=D**-0.5), (q, k, v))
    second = grads(block_gather_attention(q, k, v, plan, scale=D**-0.5), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(first, second))

