"""Zero-bubble compute orders (ZB-H1, Qi et al. 2023, https://arxiv.org/abs/2401.10241).

The backward of a stage is split into ``I`` (gradient w.r.t. the stage input, on the critical
path: the previous stage waits for it) and ``W`` (gradient w.r.t. the weights, needed only by the
optimizer step). Deferring ``W`` lets a rank fill the cool-down bubble of 1F1B with weight
gradients. The order is found by list scheduling on unit costs (F = I = W = 1): a free rank runs a
ready ``I`` first (it unblocks the rank before it), else a ready ``F`` while it holds fewer than
``p - r`` live activations (1F1B's memory bound, an activation being live from F until its W),
else its oldest pending ``W``. The result is plain data like every other schedule; the validator
checks it and measures its bubble.
"""

from __future__ import annotations

from typing import List, Tuple

Order = List[Tuple[str, int, int]]


def zero_bubble_orders(p: int, m: int) -> List[Order]:
    """Per-rank (kind, stage, micro-batch) orders of F / I / W for p stages and m micro-batches."""
    f_end = [[None] * m for _ in range(p)]  # finish time of F(r, i)
    i_end = [[None] * m for _ in range(p)]
    next_f, next_i, next_w = [0] * p, [0] * p, [0] * p
    orders: List[Order] = [[] for _ in range(p)]
    t = 0
    while any(next_w[r] < m for r in range(p)):
        chosen = []
        for r in range(p):
            chosen.append(_pick(r, p, m, t, f_end, i_end, next_f, next_i, next_w))
        for r, kind in enumerate(chosen):  # commit after all ranks chose: decisions at t see only t-1
            if kind == "F":
                f_end[r][next_f[r]] = t + 1
                orders[r].append(("F", r, next_f[r]))
                next_f[r] += 1
            elif kind == "I":
                i_end[r][next_i[r]] = t + 1
                orders[r].append(("I", r, next_i[r]))
                next_i[r] += 1
            elif kind == "W":
                orders[r].append(("W", r, next_w[r]))
                next_w[r] += 1
        t += 1
        if t > 8 * (m + p) * 3:  # cannot happen for a correct policy; guards against an endless loop
            raise RuntimeError(f"zero-bubble list scheduling did not finish for p={p}, m={m}")
    return orders


def _pick(r, p, m, t, f_end, i_end, next_f, next_i, next_w):
    i = next_i[r]
    if i < m and f_end[r][i] is not None and f_end[r][i] <= t and (
        r == p - 1 or (i_end[r + 1][i] is not None and i_end[r + 1][i] <= t)
    ):
        return "I"
    f = next_f[r]
    live = next_f[r] - next_w[r]
    if f < m and live < p - r and (r == 0 or (f_end[r - 1][f] is not None and f_end[r - 1][f] <= t)):
        return "F"
    if next_w[r] < next_i[r]:
        return "W"
    return None
