"""Cross-entropy over vocabulary-parallel logits, without gathering the full logits on any rank.

Each rank holds logits for its slice of the (padded) vocabulary, ``(N, V_pad / tp)``. The loss
``log(sum_v exp(z_v)) - z_target`` needs three global quantities per token: the max (for stability),
the sum of exponentials, and the target's logit (held by exactly one rank). They cost two small
all-reduces of ``N`` (max) and ``2N`` (target logit, sum-exp) floats instead of moving ``N x V``.
Padded vocabulary columns are set to ``-inf`` before anything else, so they contribute nothing to the
loss or its gradient. Megatron-LM (arXiv:1909.08053, section 3) describes the same scheme.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_scale.comm import collectives


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, ignore_index, tag):
        # logits (N, V_local), targets (N,)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        z = logits.to(dtype).clone()
        n_local = z.shape[-1]
        valid_cols = max(0, min(n_local, vocab_size - vocab_start))
        if valid_cols < n_local:
            z[:, valid_cols:] = float("-inf")  # vocabulary padding: exp(-inf) = 0 in every sum below
        zmax = z.max(dim=-1).values  # (N,)
        collectives.all_reduce(zmax, group, op=dist.ReduceOp.MAX, tag=tag)
        z -= zmax.unsqueeze(-1)
        in_range = (targets >= vocab_start) & (targets < vocab_start + valid_cols)
        local_t = (targets - vocab_start).clamp(0, n_local - 1)
        picked = z.gather(1, local_t.unsqueeze(1)).squeeze(1) * in_range  # target logit on its owner, else 0
        z.exp_()  # z now holds exp(z - max)
        stats = torch.stack([picked, z.sum(dim=-1)])  # (2, N)
        collectives.all_reduce(stats, group, tag=tag)
        picked, sum_exp = stats[0], stats[1]
        keep = targets != ignore_index
        count = keep.sum()
        loss = ((torch.log(sum_exp) - picked) * keep).sum() / count
        z /= sum_exp.unsqueeze(-1)  # softmax over the full vocabulary, this rank's columns
        ctx.save_for_backward(z, local_t, in_range, keep, count)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, in_range, keep, count = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= in_range.to(g.dtype)
        g *= (keep.to(g.dtype) * (grad.to(g.dtype) / count)).unsqueeze(-1)
        return g.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, *,
                                 vocab_size: Optional[int] = None, ignore_index: int = -100,
                                 tag: str = "tp/cross_entropy") -> torch.Tensor:
    """Mean cross-entropy of ``targets`` under vocabulary-parallel ``logits``.

    ``logits``: ``(..., V_pad / tp)``, this rank's contiguous slice of the padded vocabulary (the output
    of a ``vocab_colwise`` head). ``targets``: ``(...)`` ids in ``[0, vocab_size)`` or ``ignore_index``.
    ``vocab_size``: the true vocabulary size (defaults to ``tp * V_local``, i.e. no padding).
    Equals ``F.cross_entropy(full_logits, targets)`` on every rank, in at least float32 (like ``lm_loss``).
    """
    tp = collectives.group_size(group)
    n_local = logits.shape[-1]
    vocab_size = tp * n_local if vocab_size is None else vocab_size
    if not 0 < vocab_size <= tp * n_local:
        raise ValueError(f"vocab_size={vocab_size} does not fit {tp} shards of {n_local} logits")
    start = collectives.group_rank(group) * n_local
    flat = logits.reshape(-1, n_local)
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), group, start, vocab_size, ignore_index, tag)
