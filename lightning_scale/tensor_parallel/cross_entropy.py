"""Cross-entropy over vocabulary-parallel logits, without gathering the full logits on any rank.

Each rank holds logits for its slice of the (padded) vocabulary, ``(N, V_pad / tp)``. The loss
``log(sum_v exp(z_v)) - z_target`` needs global quantities per token: the sum of exponentials and the
target's logit (held by exactly one rank), plus, in Megatron-LM's scheme (arXiv:1909.08053, section 3),
the max for stability: two all-reduces, of ``N`` (max) and ``2N`` (target logit, sum-exp) floats.

Here the common case takes *one* all-reduce of the same ``3N`` floats: ``exp(z)`` cannot overflow or
lose precision while the logits stay within ``+-60`` (float32; ``+-600`` in float64), which each rank
checks for its own rows, so no shift has to be agreed on first. The third row of the all-reduced
``(3, N)`` block carries the check: a token whose logits leave that range on some rank (or are very
negative on every rank) makes all ranks take Megatron's path for the step (max all-reduce, then the
sums again), with the same result. A rank's vocabulary padding is never read, so it contributes
nothing to the loss or its gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_scale.comm import collectives, pairwise
from lightning_scale.tensor_parallel.vocab_range import check_vocab_range


def _exp_range(dtype: torch.dtype) -> float:
    """|max logit| up to which ``sum exp(z)`` over any vocabulary neither overflows nor underflows."""
    return 600.0 if dtype == torch.float64 else 60.0


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: 3 passes over this rank's logits (max, exp, sum), no copies, usually one all-reduce.

    Row ``i`` of this rank is exponentiated with a local shift ``s_i``: 0 when its max ``m_i`` is in
    ``[-R, R]`` (the common case), else ``m_i``. The exponentials go into a new buffer, or into the
    logits themselves when the caller will not read them again (``inplace``, as Megatron-LM does); the
    backward turns them into the gradient in place.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, ignore_index, tag, inplace, mean=True):
        # logits (N, V_local), targets (N,)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        n_rows, n_local = logits.shape
        tp = collectives.group_size(group)
        valid_cols = max(0, min(n_local, vocab_size - vocab_start))
        z = logits.detach()  # plain tensor: no autograd view bookkeeping for the slices / in-place ops below
        z = z[:, :valid_cols] if valid_cols < n_local else z  # vocabulary padding is never read
        owned = inplace
        if z.dtype != dtype:
            z, owned = z.to(dtype), True
        if valid_cols:
            local_max = z.amax(dim=-1)  # (N,)
        else:
            local_max = torch.full((n_rows,), float("-inf"), dtype=dtype, device=logits.device)
        in_range = (targets >= vocab_start) & (targets < vocab_start + valid_cols)
        local_t = (targets - vocab_start).clamp(0, max(valid_cols, 1) - 1)
        if valid_cols:
            # the target's logit on the rank that owns it, else 0 (read before z may be overwritten)
            picked = torch.where(in_range, z.gather(1, local_t.unsqueeze(1)).squeeze(1), 0.0)
        else:
            picked = torch.zeros(n_rows, dtype=dtype, device=logits.device)
        bound = _exp_range(dtype)
        high, low = local_max > bound, local_max < -bound
        shift = torch.where(high | low, local_max, 0.0)  # (N,): 0 for almost every row
        if z.device.type != "cpu" or bool((high | low).any()):  # rare on CPU (no host sync on GPUs)
            s = shift.unsqueeze(-1)
            exp = (z.sub_(s) if owned else torch.sub(z, s)).exp_()
        else:
            exp = z.exp_() if owned else z.exp()  # (N, valid): exp(z - shift)
        local_sum = exp.sum(dim=-1)
        # flag: tp + 1 for a row that overflows here, 1 for a row whose max is usable here, 0 otherwise;
        # summed over the ranks it is in [1, tp] exactly when no rank overflows and one rank is usable.
        flag = torch.where(high, float(tp + 1), torch.where(low, 0.0, 1.0)).to(dtype)
        stats = torch.stack([picked, torch.where(high, 0.0, local_sum * torch.exp(shift)), flag])  # (3, N)
        pairwise.all_reduce(stats, group, tag=tag)
        picked, sum_exp, flag = stats[0], stats[1], stats[2]
        if bool(((flag < 0.5) | (flag > tp + 0.5)).any()):  # same decision on every rank: flag was all-reduced
            gmax = local_max.clone()  # Megatron's path: agree on the max, then sum rescaled exponentials
            collectives.all_reduce(gmax, group, op=dist.ReduceOp.MAX, tag=tag)
            scale = torch.exp(shift - gmax)  # (N,): exp(shift - global max) <= 1
            sum_exp = local_sum * scale
            pairwise.all_reduce(sum_exp, group, tag=tag)
            picked = picked - gmax  # the loss is log(sum_v exp(z_v - M)) - (z_target - M)
        else:
            scale = torch.exp(shift)
        keep = targets != ignore_index
        count = keep.sum() if mean else torch.ones((), dtype=torch.long, device=logits.device)  # "sum": no division
        loss = ((torch.log(sum_exp) - picked) * keep).sum() / count
        ctx.save_for_backward(exp, scale / sum_exp, local_t, in_range, keep, count)
        ctx.logits_dtype, ctx.n_local = logits.dtype, n_local
        return loss

    @staticmethod
    def backward(ctx, grad):
        # exp is turned into the gradient in place: a second backward through this node (retain_graph) is
        # refused by autograd's saved-tensor version check rather than silently wrong.
        exp, norm, local_t, in_range, keep, count = ctx.saved_tensors
        coef = keep.to(exp.dtype) * (grad.to(exp.dtype) / count)  # (N,) d loss / d token loss
        g = exp.mul_((norm * coef).unsqueeze(-1))  # softmax * coef, this rank's columns
        if g.shape[1]:
            rows = torch.arange(g.shape[0], device=g.device)
            g[rows, local_t] -= coef * in_range.to(g.dtype)  # - one-hot(target) * coef on the owner
        if g.shape[1] < ctx.n_local:  # zero gradient for the vocabulary padding
            g = torch.cat([g, g.new_zeros(g.shape[0], ctx.n_local - g.shape[1])], dim=1)
        return g.to(ctx.logits_dtype), None, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, *,
                                 vocab_size: Optional[int] = None, ignore_index: int = -100,
                                 tag: str = "tp/cross_entropy", inplace: bool = False, reduction: str = "mean"
                                 ) -> torch.Tensor:
    """Mean cross-entropy of ``targets`` under vocabulary-parallel ``logits``.

    ``logits``: ``(..., V_pad / tp)``, this rank's contiguous slice of the padded vocabulary (the output
    of a ``vocab_colwise`` head). ``targets``: ``(...)`` ids in ``[0, vocab_size)`` or ``ignore_index``.
    ``vocab_size``: the true vocabulary size (defaults to ``tp * V_local``, i.e. no padding).
    Equals ``F.cross_entropy(full_logits, targets)`` on every rank, in at least float32 (like ``lm_loss``).
    ``inplace=True``: the caller will not read ``logits`` again, so their buffer is reused for the
    exponentials and the gradient (saves one logits-sized buffer; the head's backward never reads them).
    ``reduction="sum"``: the summed loss (a chunk of the chunked loss, ``lightning_scale.nn.chunked_loss``).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: use 'mean' or 'sum'")
    tp = collectives.group_size(group)
    n_local = logits.shape[-1]
    vocab_size = tp * n_local if vocab_size is None else vocab_size
    if not 0 < vocab_size <= tp * n_local:
        raise ValueError(f"vocab_size={vocab_size} does not fit {tp} shards of {n_local} logits")
    # a target outside the vocabulary: an error, as F.cross_entropy's (no rank owns it: its logit would count as 0)
    check_vocab_range(targets, vocab_size, "vocab_parallel_cross_entropy: target", allowed=ignore_index,
                      hint=f" and is not ignore_index={ignore_index} (F.cross_entropy raises 'out of bounds')")
    start = collectives.group_rank(group) * n_local
    flat = logits.reshape(-1, n_local)
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), group, start, vocab_size, ignore_index, tag,
                                            inplace, reduction == "mean")
