"""Fused block-sparse flash attention: Triton kernels for the forward and the backward pass.

Algorithm: FlashAttention-2 (Dao, https://arxiv.org/abs/2307.08691) restricted to the tiles that a
block layout lists. The forward program of query tile ``m`` walks only the key tiles of its row list,
keeps a running max / sum (online softmax) and stores the log-sum-exp. The backward recomputes the
scores tile by tile: one program per key tile accumulates dK, dV over the transposed (column) list,
one program per query tile accumulates dQ over the row list, so no atomics are needed and results
are deterministic.

Programs own BLOCK_M query rows (or BLOCK_N key rows) and step through each listed tile in
sub-blocks, so the index granularity (TILE) and the register tiles are chosen independently.
Scores are kept in log2 units (``qk_scale = scale * log2(e)``) so ``exp2`` can be used. All masks
(sequence end, causal diagonal, fine layout inside coarse tiles, key padding, bias) meet in
:func:`_masked_scores`. Tensors q, k, v, o, dO, dq, dk, dv are contiguous (B, H, L, D).
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# Reductions go through tl.reduce with Triton's own combine functions instead of tl.max / tl.sum /
# tl.zeros: those are @jit functions of triton.language, which are unusable in the interpreter when
# triton.language was imported before TRITON_INTERPRET was set (e.g. by torch or Lightning during
# test collection). The interpreter recognises these combine functions and reduces with numpy.
@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


_SUM = getattr(tl.standard, "_sum_combine", _add_combine)
_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """fp32 inputs use full-precision products (IEEE) instead of TF32; fp16/bf16 use tensor cores."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _masked_scores(
    s, offs_m, offs_n, full, b, h, L, NB,
    layout_ptr, kpm_ptr, bias_ptr, stride_bb, stride_bh, stride_bm, stride_bn,
    CAUSAL: tl.constexpr, FACTOR: tl.constexpr, BLOCK: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """s (BM, BN) fp32 in log2 units -> the same with masked entries at -inf and additive terms added."""
    valid = (offs_m[:, None] < L) & (offs_n[None, :] < L)
    if CAUSAL:
        # Causal lists hold only tiles n <= m, and off the diagonal tile this holds anyway.
        valid = valid & (offs_m[:, None] >= offs_n[None, :])
    if FACTOR > 1:
        # Coarse tile partly on: apply the fine layout. Full tiles skip the load (mask all false).
        # (The scalar flag is broadcast arithmetically: bool-scalar | bool-tensor misbehaves in the interpreter.)
        need = (offs_m[:, None] * 0 + offs_n[None, :] * 0 + full) == 0
        fine_ptr = layout_ptr + h * NB * NB + (offs_m // BLOCK)[:, None] * NB + (offs_n // BLOCK)[None, :]
        fine = tl.load(fine_ptr, mask=valid & need, other=1)
        valid = valid & (fine != 0)
    if HAS_BIAS:
        bias_off = (b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
                    + offs_m[:, None].to(tl.int64) * stride_bm + offs_n[None, :].to(tl.int64) * stride_bn)
        s += tl.load(bias_ptr + bias_off, mask=valid, other=0.0).to(tl.float32) * 1.4426950408889634
    if HAS_KPM:
        kpm = tl.load(kpm_ptr + b.to(tl.int64) * L + offs_n, mask=offs_n < L, other=0.0).to(tl.float32)
        s += kpm[None, :] * 1.4426950408889634
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _load_tile(ptr, offs, offs_d, L, D, UPCAST: tl.constexpr):
    """(BT, BD) rows ``offs`` of a (L, D) matrix, zero outside; upcast to fp32 for the interpreter."""
    x = tl.load(ptr + offs[:, None] * D + offs_d[None, :], mask=(offs[:, None] < L) & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, row_ptr, col_idx, col_full, layout_ptr, kpm_ptr, bias_ptr,
    stride_bb, stride_bh, stride_bm, stride_bn,
    H, L, D, NB, num_tiles, qk_scale,
    TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr, FACTOR: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One program per BLOCK_M query rows; walks the key tiles of its tile's row list in BLOCK_N steps."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    m_tile = pid // (TILE // BLOCK_M)
    base = bh.to(tl.int64) * L * D
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + base, offs_m, offs_d, L, D, UPCAST)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    start = tl.load(row_ptr + h * num_tiles + m_tile)
    end = tl.load(row_ptr + h * num_tiles + m_tile + 1)
    for idx in range(start, end):
        n_tile = tl.load(col_idx + idx)
        full = tl.load(col_full + idx)
        for j in tl.static_range(TILE // BLOCK_N):
            offs_n = n_tile * TILE + j * BLOCK_N + tl.arange(0, BLOCK_N)
            k = _load_tile(K + base, offs_n, offs_d, L, D, UPCAST)
            v = _load_tile(V + base, offs_n, offs_d, L, D, UPCAST)
            s = _dot(q, tl.trans(k), IEEE) * qk_scale
            s = _masked_scores(s, offs_m, offs_n, full, b, h, L, NB, layout_ptr, kpm_ptr, bias_ptr,
                               stride_bb, stride_bh, stride_bm, stride_bn, CAUSAL, FACTOR, BLOCK, HAS_KPM, HAS_BIAS)
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: keep exp2 finite
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
    empty = l_i == 0.0  # rows with no allowed key: output 0, lse +inf (so backward probabilities are 0)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    o_ptr = O + base + offs_m[:, None] * D + offs_d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=(offs_m[:, None] < L) & (offs_d[None, :] < D))
    tl.store(LSE + bh.to(tl.int64) * L + offs_m, lse, mask=offs_m < L)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, col_ptr, row_idx, row_full, layout_ptr, kpm_ptr, bias_ptr,
    stride_bb, stride_bh, stride_bm, stride_bn,
    H, L, D, NB, num_tiles, qk_scale, scale,
    TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr, FACTOR: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One program per BLOCK_N keys; walks the query tiles of its tile's column list in BLOCK_M steps."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    n_tile = pid // (TILE // BLOCK_N)
    base = bh.to(tl.int64) * L * D
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K + base, offs_n, offs_d, L, D, UPCAST)
    v = _load_tile(V + base, offs_n, offs_d, L, D, UPCAST)
    dk = tl.full((BLOCK_N, BLOCK_D), 0.0, tl.float32)
    dv = tl.full((BLOCK_N, BLOCK_D), 0.0, tl.float32)
    start = tl.load(col_ptr + h * num_tiles + n_tile)
    end = tl.load(col_ptr + h * num_tiles + n_tile + 1)
    for idx in range(start, end):
        m_tile = tl.load(row_idx + idx)
        full = tl.load(row_full + idx)
        for i in tl.static_range(TILE // BLOCK_M):
            offs_m = m_tile * TILE + i * BLOCK_M + tl.arange(0, BLOCK_M)
            q = _load_tile(Q + base, offs_m, offs_d, L, D, UPCAST)
            do = _load_tile(DO + base, offs_m, offs_d, L, D, UPCAST)
            lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=float("inf"))
            delta = tl.load(DELTA + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * qk_scale
            s = _masked_scores(s, offs_m, offs_n, full, b, h, L, NB, layout_ptr, kpm_ptr, bias_ptr,
                               stride_bb, stride_bh, stride_bm, stride_bn, CAUSAL, FACTOR, BLOCK, HAS_KPM, HAS_BIAS)
            p = tl.math.exp2(s - lse[:, None])  # (BM, BN)
            dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
            dp = _dot(do, tl.trans(v), IEEE)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
    mask = (offs_n[:, None] < L) & (offs_d[None, :] < D)
    ptr = base + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + ptr, (dk * scale).to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + ptr, dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, row_ptr, col_idx, col_full, layout_ptr, kpm_ptr, bias_ptr,
    stride_bb, stride_bh, stride_bm, stride_bn,
    H, L, D, NB, num_tiles, qk_scale, scale,
    TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr, FACTOR: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One program per BLOCK_M queries; walks the key tiles of its tile's row list in BLOCK_N steps."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    m_tile = pid // (TILE // BLOCK_M)
    base = bh.to(tl.int64) * L * D
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + base, offs_m, offs_d, L, D, UPCAST)
    do = _load_tile(DO + base, offs_m, offs_d, L, D, UPCAST)
    lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=0.0)
    dq = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    start = tl.load(row_ptr + h * num_tiles + m_tile)
    end = tl.load(row_ptr + h * num_tiles + m_tile + 1)
    for idx in range(start, end):
        n_tile = tl.load(col_idx + idx)
        full = tl.load(col_full + idx)
        for j in tl.static_range(TILE // BLOCK_N):
            offs_n = n_tile * TILE + j * BLOCK_N + tl.arange(0, BLOCK_N)
            k = _load_tile(K + base, offs_n, offs_d, L, D, UPCAST)
            v = _load_tile(V + base, offs_n, offs_d, L, D, UPCAST)
            s = _dot(q, tl.trans(k), IEEE) * qk_scale
            s = _masked_scores(s, offs_m, offs_n, full, b, h, L, NB, layout_ptr, kpm_ptr, bias_ptr,
                               stride_bb, stride_bh, stride_bm, stride_bn, CAUSAL, FACTOR, BLOCK, HAS_KPM, HAS_BIAS)
            p = tl.math.exp2(s - lse[:, None])
            dp = _dot(do, tl.trans(v), IEEE)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(DQ + base + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < L) & (offs_d[None, :] < D))
