"""Block-sparse attention on the CPU (or any device) in plain torch: gather, batched matmul, scatter.

Why not FlexAttention or a masked SDPA: FlexAttention has no CPU backward, and a masked SDPA
materializes (L, L) scores. Here each query block row gathers only the key/value blocks its layout
lists and runs one batched matmul for all rows that list the same number of blocks. Rows are processed
in chunks whose working set stays under ``chunk_bytes``, and the backward recomputes the scores from
the saved log-sum-exp (flash-attention style), so memory is O(L * window) plus one chunk — training
long sequences on a CPU works.

Parallelism: chunks run on a small pool of threads (see :mod:`._workers`); the forward hands out
chunks dynamically, the backward gives each thread whole (batch, head) pairs so dK/dV rows are never
shared: no atomics, no per-thread copies, deterministic results.

Shapes: q, k, v arrive as (B, H, L, D) and are viewed as ``B * H * NB`` blocks of (block, D); a
"row" is one query block ``(b, h, i)`` and its key list holds the flat ids ``(b * H + h) * NB + j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from lightning_scale.kernels.block_sparse_attention.index import causal_layout
from lightning_scale.nn._workers import run_tasks, static_shares


@dataclass(frozen=True)
class Chunk:
    """Query block rows that attend to the same number of key blocks, processed together."""

    count: int  # key blocks per row
    diagonal_last: bool  # causal rows whose last listed block is their own diagonal block
    rows: torch.Tensor  # (R,) flat query block ids
    cols: torch.Tensor  # (R * count,) flat key block ids, row-major
    start: int  # first row id when the rows are consecutive (a slice replaces a gather), else -1


@dataclass(frozen=True)
class GatherPlan:
    batch: int
    num_heads: int
    num_blocks: int
    block: int
    causal: bool
    # Per worker. Each (batch, head) pair belongs to one worker, so workers write disjoint dK/dV rows.
    shares: Tuple[Tuple[Chunk, ...], ...]

    @property
    def num_rows(self) -> int:
        return self.batch * self.num_heads * self.num_blocks

    @property
    def chunks(self) -> List[Chunk]:
        return [c for share in self.shares for c in share]


def auto_chunk_bytes(batch: int, heads: int, seq_len: int, head_dim: int, element_size: int, workers: int) -> int:
    """Working set per worker: the size of one (B, H, L, D) tensor split over the workers, clamped to
    [2, 24] MiB — large enough for efficient matmuls, small enough that the chunks stay a fraction
    of the O(L) tensors (so peak memory stays close to dense flash attention's)."""
    unit = batch * heads * seq_len * head_dim * element_size
    return int(min(max(unit // workers, 2 << 20), 24 << 20))


def build_gather_plan(layout: torch.Tensor, block: int, batch: int, head_dim: int, causal: bool,
                      chunk_bytes: Optional[int] = None, element_size: int = 4, workers: int = 1,
                      device: Optional[torch.device] = None) -> GatherPlan:
    """Split the rows of ``layout`` (H, NB, NB) over ``workers`` by (batch, head), group each share's
    rows by block count, and chunk each group so one chunk's working set stays under ``chunk_bytes``.
    Index tensors live on ``device`` (that of the inputs; the CPU by default)."""
    fine = causal_layout(layout, causal).cpu()  # (H, NB, NB)
    heads, nb, _ = fine.shape
    workers = max(1, min(workers, batch * heads))
    chunk_bytes = chunk_bytes or auto_chunk_bytes(batch, heads, nb * block, head_dim, element_size, workers)
    counts = fine.sum(-1)  # (H, NB)
    on_diag = fine.diagonal(dim1=1, dim2=2) & causal  # (H, NB)
    pair_cost = counts.sum(-1).repeat(batch).tolist()  # per (b, h), b-major
    shares = []
    for pairs in static_shares(pair_cost, workers):
        pairs = torch.tensor(pairs, dtype=torch.long)
        h = pairs % heads  # (P,) head of each (b, h) pair (pairs are b * H + h)
        base = pairs * nb  # flat id of block 0 of each pair
        chunks: List[Chunk] = []
        for count in sorted(set(counts[h].flatten().tolist()) - {0}):
            for diag in (False, True):
                p, r = ((counts[h] == count) & (on_diag[h] == diag)).nonzero(as_tuple=True)  # (G,)
                if p.numel() == 0:
                    continue
                rows = base[p] + r  # (G,)
                cols = fine[h[p], r].nonzero(as_tuple=True)[1].view(-1, count) + base[p, None]  # (G, count)
                # Per row in backward: K^T, V^T, K gathered, scores and dP, dK/dV partials.
                per_row = element_size * count * block * (2 * block + 5 * head_dim)
                step = max(1, chunk_bytes // per_row)
                for i in range(0, rows.numel(), step):
                    chunk_rows = rows[i : i + step].contiguous()
                    chunks.append(Chunk(count=count, diagonal_last=diag, rows=chunk_rows.to(device),
                                        cols=cols[i : i + step].reshape(-1).contiguous().to(device),
                                        start=_run_start(chunk_rows)))
        shares.append(tuple(chunks))
    return GatherPlan(batch=batch, num_heads=heads, num_blocks=nb, block=block, causal=causal, shares=tuple(shares))


def _run_start(rows: torch.Tensor) -> int:
    """First id if ``rows`` are consecutive (then a slice replaces a gather), else -1."""
    first = int(rows[0])
    return first if bool((rows == torch.arange(first, first + rows.numel())).all()) else -1


class _Masks:
    """Additive score terms for one chunk: causal triangle, key padding, bias (each optional)."""

    def __init__(self, plan: GatherPlan, key_padding_mask: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 dtype: torch.dtype, device: torch.device) -> None:
        B, H, NB, bs = plan.batch, plan.num_heads, plan.num_blocks, plan.block
        self.block = bs
        self.triangle = torch.full((bs, bs), float("-inf"), dtype=dtype, device=device).triu(1)
        self.kpm = None
        if key_padding_mask is not None:  # (B, L) -> one (bs,) row per key block id
            kpm = key_padding_mask.to(dtype).view(B, 1, NB, bs).expand(B, H, NB, bs)
            self.kpm = kpm.reshape(B * H * NB, bs)
        self.bias = None
        if bias is not None:  # broadcast view (B, H, NB, bs, NB, bs), gathered per chunk
            self.bias = bias.to(dtype).expand(B, H, NB * bs, NB * bs).reshape(B, H, NB, bs, NB, bs)
            self.shape = (H, NB)

    @property
    def can_empty_rows(self) -> bool:
        return self.kpm is not None or self.bias is not None

    def apply(self, scores: torch.Tensor, chunk: Chunk) -> None:
        """Add the masks to ``scores`` (R, bs, count * bs) in place."""
        rows, cols = chunk.rows, chunk.cols
        R, bs, count = rows.numel(), self.block, chunk.count
        if chunk.diagonal_last:
            scores[:, :, (count - 1) * bs :] += self.triangle
        if self.kpm is not None:
            scores += self.kpm.index_select(0, cols).view(R, 1, count * bs)
        if self.bias is not None:
            H, NB = self.shape
            r_bh, r_i = (rows // NB)[:, None], (rows % NB)[:, None]  # (R, 1)
            c_j = (cols % NB).view(R, count)  # (R, count)
            tiles = self.bias[r_bh // H, r_bh % H, r_i, :, c_j, :]  # (R, count, bs, bs)
            scores += tiles.permute(0, 2, 1, 3).reshape(R, bs, count * bs)


class _Blocks:
    """q, k, v as (N, bs, D) blocks, plus per-block transposes of k (and v) so that the score matmuls
    read a contiguous (D, count * bs) right operand: about 1.5x faster than a transposed one."""

    def __init__(self, qb, kb, vb, scale: float, transpose_v: bool) -> None:
        N, bs, D = kb.shape
        self.qb, self.kb, self.vb, self.scale, self.block, self.dim = qb, kb, vb, scale, bs, D
        self.kt = kb.transpose(1, 2).contiguous().view(N * D, bs)  # row (j * D + d) = k[j, :, d]
        self.vt = vb.transpose(1, 2).contiguous().view(N * D, bs) if transpose_v else None
        self.dims = torch.arange(D, device=kb.device).view(1, D, 1)

    @staticmethod
    def rows(t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        return t[chunk.start : chunk.start + chunk.rows.numel()] if chunk.start >= 0 else t.index_select(0, chunk.rows)

    def scaled_q(self, chunk: Chunk) -> torch.Tensor:
        """(R, bs, D) query rows times the softmax scale (scaling q beats scaling every score)."""
        return self.rows(self.qb, chunk) * self.scale

    def gather(self, t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """(N, bs, D) -> (R, count * bs, D) for the listed key blocks of the chunk's rows."""
        return t.index_select(0, chunk.cols).view(chunk.rows.numel(), -1, self.dim)

    def gather_t(self, t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """Transposed blocks (N * D, bs) -> (R, D, count * bs)."""
        R = chunk.rows.numel()
        ids = (chunk.cols.view(R, 1, -1) * self.dim + self.dims).reshape(-1)  # (R, D, count)
        return t.index_select(0, ids).view(R, self.dim, -1)


def _write(dst: torch.Tensor, chunk: Chunk, src: torch.Tensor) -> None:
    src = src.to(dst.dtype)  # e.g. bf16 / fp16 rows into the fp32 log-sum-exp buffer (index_copy_ needs one dtype)
    if chunk.start >= 0:
        dst[chunk.start : chunk.start + chunk.rows.numel()] = src
    else:
        dst.index_copy_(0, chunk.rows, src)


def _forward_chunk(blocks: _Blocks, masks: _Masks, out, lse, chunk: Chunk) -> None:
    scores = torch.bmm(blocks.scaled_q(chunk), blocks.gather_t(blocks.kt, chunk))  # (R, bs, c * bs)
    masks.apply(scores, chunk)
    if masks.can_empty_rows:  # rows may be fully masked: softmax would give NaN
        row_lse = torch.logsumexp(scores, dim=-1)  # (R, bs); -inf for fully masked rows
        row_lse.masked_fill_(row_lse == float("-inf"), float("inf"))  # -> probabilities 0
        probs = scores.sub_(row_lse.unsqueeze(-1)).exp_()
    else:
        # Fused softmax; the log-sum-exp follows from the row max m and the largest
        # probability 1 / sum(exp(s - m)): lse = m - log(max p). Two cheap reads, no exp pass.
        row_max = scores.amax(dim=-1) if lse is not None else None
        probs = torch.softmax(scores, dim=-1)
        row_lse = row_max - probs.amax(dim=-1).log_() if lse is not None else None
    if lse is not None:
        _write(lse, chunk, row_lse)
    _write(out, chunk, torch.bmm(probs, blocks.gather(blocks.vb, chunk)))


def _forward(blocks: _Blocks, plan: GatherPlan, masks: _Masks, need_lse: bool):
    """-> out (N, bs, D), lse (N, bs) or None. Chunks write disjoint rows, so workers take any
    chunk as they come free (robust to a descheduled thread)."""
    qb = blocks.qb
    out = torch.zeros_like(qb)
    lse = torch.full(qb.shape[:2], float("inf"), dtype=qb.dtype, device=qb.device) if need_lse else None
    chunks = plan.chunks
    run_tasks(lambda i: _forward_chunk(blocks, masks, out, lse, chunks[i]), len(chunks), qb.device)
    return out, lse


def _backward_chunk(blocks: _Blocks, masks: _Masks, lse, delta, dout, dq, dk, dv, chunk: Chunk) -> None:
    bs, D = blocks.block, blocks.dim
    q, do = blocks.scaled_q(chunk), blocks.rows(dout, chunk)  # (R, bs, D)
    scores = torch.bmm(q, blocks.gather_t(blocks.kt, chunk))  # (R, bs, c * bs)
    masks.apply(scores, chunk)
    probs = scores.sub_(blocks.rows(lse, chunk).unsqueeze(-1)).exp_()
    # (a backward run inside autocast, as the pipeline runtime's is, makes the matmuls half: the accumulators keep
    # the inputs' dtype)
    dv.index_add_(0, chunk.cols, torch.bmm(probs.transpose(1, 2), do).view(-1, bs, D).to(dv.dtype))
    dscores = torch.bmm(do, blocks.gather_t(blocks.vt, chunk))  # dP (R, bs, c * bs)
    dscores.sub_(blocks.rows(delta, chunk).unsqueeze(-1)).mul_(probs)  # dS = P * (dP - delta)
    _write(dq, chunk, torch.bmm(dscores, blocks.gather(blocks.kb, chunk)).mul_(blocks.scale))
    dk.index_add_(0, chunk.cols, torch.bmm(dscores.transpose(1, 2), q).view(-1, bs, D).to(dk.dtype))


def _backward(blocks: _Blocks, out, lse, dout, plan: GatherPlan, masks: _Masks):
    """Recompute probabilities per chunk. dQ rows are written once; dK/dV accumulate by index_add,
    and since every (batch, head) belongs to one worker's share, workers never add to the same row
    (no locks, no per-worker copies, a fixed order: deterministic)."""
    delta = (dout * out).sum(-1)  # (N, bs): rowsum(dO * O)
    dq, dk, dv = torch.zeros_like(blocks.qb), torch.zeros_like(blocks.kb), torch.zeros_like(blocks.vb)

    def share(i: int) -> None:
        for chunk in plan.shares[i]:
            _backward_chunk(blocks, masks, lse, delta, dout, dq, dk, dv, chunk)

    run_tasks(share, len(plan.shares), dout.device)
    return dq, dk, dv


class BlockGatherAttention(torch.autograd.Function):
    """Autograd wrapper; masks and bias are constants (no gradient flows to them)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: GatherPlan, key_padding_mask, bias, scale: float):
        B, H, L, D = q.shape
        shape = (plan.num_rows, plan.block, D)
        qb, kb, vb = (t.contiguous().view(shape) for t in (q, k, v))
        masks = _Masks(plan, key_padding_mask, bias, q.dtype, q.device)
        out, lse = _forward(_Blocks(qb, kb, vb, scale, transpose_v=False), plan, masks, need_lse=True)
        ctx.save_for_backward(qb, kb, vb, out, lse, key_padding_mask, bias)
        ctx.plan, ctx.scale, ctx.shape = plan, scale, (B, H, L, D)
        return out.view(B, H, L, D)

    @staticmethod
    def backward(ctx, grad_out):
        qb, kb, vb, out, lse, key_padding_mask, bias = ctx.saved_tensors
        masks = _Masks(ctx.plan, key_padding_mask, bias, qb.dtype, qb.device)
        dout = grad_out.contiguous().view(qb.shape)
        dq, dk, dv = _backward(_Blocks(qb, kb, vb, ctx.scale, transpose_v=True), out, lse, dout, ctx.plan, masks)
        return dq.view(ctx.shape), dk.view(ctx.shape), dv.view(ctx.shape), None, None, None, None


def block_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: GatherPlan, *,
                           key_padding_mask: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                           scale: float) -> torch.Tensor:
    """q, k, v (B, H, L, D) -> (B, H, L, D). Masks are additive: key_padding_mask (B, L), bias
    broadcastable to (B, H, L, L)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return BlockGatherAttention.apply(q, k, v, plan, key_padding_mask, bias, scale)
    # Inference: no log-sum-exp to keep, nothing saved.
    B, H, L, D = q.shape
    shape = (plan.num_rows, plan.block, D)
    masks = _Masks(plan, key_padding_mask, bias, q.dtype, q.device)
    blocks = _Blocks(q.reshape(shape), k.reshape(shape), v.reshape(shape), scale, transpose_v=False)
    out, _ = _forward(blocks, plan, masks, need_lse=False)
    return out.view(B, H, L, D)
