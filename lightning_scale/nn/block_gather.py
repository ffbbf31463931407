"""Block-sparse attention on the CPU (or any device) in plain torch: gather, batched matmul, scatter.

Why not FlexAttention or a masked SDPA: FlexAttention has no CPU backward, and a masked SDPA
materializes (L, L) scores. Here each query block row gathers only the key/value blocks its layout
lists and runs one batched matmul for all rows that list the same number of blocks. Rows are processed
in chunks whose working set stays under ``chunk_bytes``, and the backward recomputes the scores from
the saved log-sum-exp (flash-attention style), so memory is O(L * window) plus one chunk — training
long sequences on a CPU works.

Shapes: q, k, v arrive as (B, H, L, D) and are viewed as ``B * H * NB`` blocks of (block, D); a
"row" is one query block ``(b, h, i)`` and its key list holds the flat ids ``(b * H + h) * NB + j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from lightning_scale.kernels.block_sparse_attention.index import causal_layout

DEFAULT_CHUNK_BYTES = 24 << 20


@dataclass(frozen=True)
class RowGroup:
    """Query block rows that attend to the same number of key blocks, split into chunks."""

    count: int  # key blocks per row
    diagonal_last: bool  # causal rows whose last listed block is their own diagonal block
    rows: Tuple[torch.Tensor, ...]  # per chunk: (R,) flat query block ids
    cols: Tuple[torch.Tensor, ...]  # per chunk: (R * count,) flat key block ids, row-major


@dataclass(frozen=True)
class GatherPlan:
    batch: int
    num_heads: int
    num_blocks: int
    block: int
    causal: bool
    groups: Tuple[RowGroup, ...]

    @property
    def num_rows(self) -> int:
        return self.batch * self.num_heads * self.num_blocks


def build_gather_plan(layout: torch.Tensor, block: int, batch: int, head_dim: int, causal: bool,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES, element_size: int = 4) -> GatherPlan:
    """Group the rows of ``layout`` (H, NB, NB) by their block count; chunk each group by ``chunk_bytes``."""
    fine = causal_layout(layout, causal).cpu()  # (H, NB, NB)
    heads, nb, _ = fine.shape
    counts = fine.sum(-1)  # (H, NB)
    on_diag = fine.diagonal(dim1=1, dim2=2) & causal  # (H, NB)
    head_base = (torch.arange(batch)[:, None] * heads + torch.arange(heads)[None, :]) * nb  # (B, H)
    groups: List[RowGroup] = []
    for count in sorted(set(counts.flatten().tolist()) - {0}):
        for diag in (False, True):
            sel = (counts == count) & (on_diag == diag)  # (H, NB)
            if not bool(sel.any()):
                continue
            h, r = sel.nonzero(as_tuple=True)  # (G,)
            cols = fine[h, r].nonzero(as_tuple=True)[1].view(-1, count)  # (G, count), ascending
            rows_all = (head_base[:, h] + r).reshape(-1)  # (B * G,)
            cols_all = (head_base[:, h, None] + cols[None]).reshape(-1, count)  # (B * G, count)
            # Per row: gathered K and V, scores, and in backward dP plus dK/dV partials.
            per_row = element_size * count * block * (2 * block + 4 * head_dim)
            step = max(1, chunk_bytes // per_row)
            chunks = range(0, rows_all.numel(), step)
            groups.append(RowGroup(
                count=count, diagonal_last=diag,
                rows=tuple(rows_all[i : i + step].contiguous() for i in chunks),
                cols=tuple(cols_all[i : i + step].reshape(-1).contiguous() for i in chunks),
            ))
    return GatherPlan(batch=batch, num_heads=heads, num_blocks=nb, block=block, causal=causal, groups=tuple(groups))


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

    def apply(self, scores: torch.Tensor, group: RowGroup, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """Add the masks to ``scores`` (R, bs, count * bs) in place."""
        R, bs, count = rows.numel(), self.block, group.count
        if group.diagonal_last:
            scores[:, :, (count - 1) * bs :] += self.triangle
        if self.kpm is not None:
            scores += self.kpm.index_select(0, cols).view(R, 1, count * bs)
        if self.bias is not None:
            H, NB = self.shape
            r_bh, r_i = (rows // NB)[:, None], (rows % NB)[:, None]  # (R, 1)
            c_j = (cols % NB).view(R, count)  # (R, count)
            tiles = self.bias[r_bh // H, r_bh % H, r_i, :, c_j, :]  # (R, count, bs, bs)
            scores += tiles.permute(0, 2, 1, 3).reshape(R, bs, count * bs)


def _gather(blocks: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """(N, bs, D) blocks, (R * count,) ids -> (R, count * bs, D)."""
    return blocks.index_select(0, ids).view(rows, -1, blocks.shape[-1])


def _forward(qb, kb, vb, plan: GatherPlan, masks: _Masks, need_lse: bool):
    """qb (pre-scaled), kb, vb: (N, bs, D) -> out (N, bs, D), lse (N, bs) or None."""
    out = torch.zeros_like(qb)
    lse = torch.full(qb.shape[:2], float("inf"), dtype=qb.dtype, device=qb.device) if need_lse else None
    for group in plan.groups:
        for rows, cols in zip(group.rows, group.cols):
            R = rows.numel()
            k, v = _gather(kb, cols, R), _gather(vb, cols, R)  # (R, c * bs, D)
            scores = torch.bmm(qb.index_select(0, rows), k.transpose(1, 2))  # (R, bs, c * bs)
            masks.apply(scores, group, rows, cols)
            if need_lse or masks.can_empty_rows:
                row_lse = torch.logsumexp(scores, dim=-1)  # (R, bs); -inf for fully masked rows
                row_lse.masked_fill_(row_lse == float("-inf"), float("inf"))  # -> probabilities 0
                probs = scores.sub_(row_lse.unsqueeze(-1)).exp_()
                if lse is not None:
                    lse.index_copy_(0, rows, row_lse)
            else:
                probs = torch.softmax(scores, dim=-1)
            out.index_copy_(0, rows, torch.bmm(probs, v))
    return out, lse


def _backward(qb, kb, vb, out, lse, dout, plan: GatherPlan, masks: _Masks):
    """Recompute probabilities per chunk; dQ rows are written once, dK/dV accumulate by index_add."""
    delta = (dout * out).sum(-1)  # (N, bs): rowsum(dO * O)
    dq, dk, dv = torch.zeros_like(qb), torch.zeros_like(kb), torch.zeros_like(vb)
    for group in plan.groups:
        for rows, cols in zip(group.rows, group.cols):
            R, bs, D = rows.numel(), plan.block, qb.shape[-1]
            q, do = qb.index_select(0, rows), dout.index_select(0, rows)  # (R, bs, D)
            k, v = _gather(kb, cols, R), _gather(vb, cols, R)  # (R, c * bs, D)
            scores = torch.bmm(q, k.transpose(1, 2))  # (R, bs, c * bs)
            masks.apply(scores, group, rows, cols)
            probs = scores.sub_(lse.index_select(0, rows).unsqueeze(-1)).exp_()
            dv.index_add_(0, cols, torch.bmm(probs.transpose(1, 2), do).view(-1, bs, D))
            dscores = torch.bmm(do, v.transpose(1, 2))  # dP (R, bs, c * bs)
            dscores.sub_(delta.index_select(0, rows).unsqueeze(-1)).mul_(probs)  # dS = P * (dP - delta)
            dq.index_copy_(0, rows, torch.bmm(dscores, k))
            dk.index_add_(0, cols, torch.bmm(dscores.transpose(1, 2), q).view(-1, bs, D))
    return dq, dk, dv


class BlockGatherAttention(torch.autograd.Function):
    """Autograd wrapper; masks and bias are constants (no gradient flows to them)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: GatherPlan, key_padding_mask, bias, scale: float):
        B, H, L, D = q.shape
        shape = (plan.num_rows, plan.block, D)
        qb = (q * scale).reshape(shape)  # scaling q once is cheaper than scaling every score tile
        kb, vb = k.contiguous().view(shape), v.contiguous().view(shape)
        masks = _Masks(plan, key_padding_mask, bias, q.dtype, q.device)
        need_grad = any(ctx.needs_input_grad[:3])
        out, lse = _forward(qb, kb, vb, plan, masks, need_lse=need_grad)
        if need_grad:
            ctx.save_for_backward(qb, kb, vb, out, lse, key_padding_mask, bias)
            ctx.plan, ctx.scale, ctx.shape = plan, scale, (B, H, L, D)
        return out.view(B, H, L, D)

    @staticmethod
    def backward(ctx, grad_out):
        qb, kb, vb, out, lse, key_padding_mask, bias = ctx.saved_tensors
        masks = _Masks(ctx.plan, key_padding_mask, bias, qb.dtype, qb.device)
        dout = grad_out.contiguous().view(qb.shape)
        dq, dk, dv = _backward(qb, kb, vb, out, lse, dout, ctx.plan, masks)
        dq.mul_(ctx.scale)
        return dq.view(ctx.shape), dk.view(ctx.shape), dv.view(ctx.shape), None, None, None, None


def block_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: GatherPlan, *,
                           key_padding_mask: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                           scale: float) -> torch.Tensor:
    """q, k, v (B, H, L, D) -> (B, H, L, D). Masks are additive: key_padding_mask (B, L), bias
    broadcastable to (B, H, L, L)."""
    return BlockGatherAttention.apply(q, k, v, plan, key_padding_mask, bias, scale)
