"""Zero-bubble compute orders: ZB-H1 of Qi et al. 2023 (https://arxiv.org/abs/2401.10241).

The backward of a stage is split into ``I`` (gradient w.r.t. the stage input, on the critical
path: the previous stage waits for it) and ``W`` (gradient w.r.t. the weights, needed only by the
optimizer step). ZB-H1 keeps 1F1B's shape but lets rank r defer its weight-gradient passes by r
micro-batches, so the cool-down, where 1F1B idles waiting for input gradients, is filled with
deferred ``W`` work. With F = I = W in cost, each rank idles (p - 1) units instead of 1F1B's
3 (p - 1): the bubble is (p - 1) / (3 m + p - 1) for m >= p. An activation is live from its F
until its W, and every rank holds at most p of them (1F1B's peak, which only rank 0 reaches).
"""

from __future__ import annotations

from typing import List, Tuple

Order = List[Tuple[str, int, int]]


def zero_bubble_orders(p: int, m: int) -> List[Order]:
    """Per-rank (kind, stage, micro-batch) orders of F / I / W for p stages and m micro-batches."""
    orders: List[Order] = []
    for r in range(p):
        warm = min(p - r, m)  # one more than 1F1B: the first I of rank r comes after its warm-up
        order: Order = [("F", r, i) for i in range(warm)]
        next_f, next_w = warm, 0
        for k in range(m):
            order.append(("I", r, k))
            if k >= r:  # rank r runs W(k - r) here: r weight passes stay deferred
                order.append(("W", r, next_w))
                next_w += 1
            if next_f < m:
                order.append(("F", r, next_f))
                next_f += 1
        order += [("W", r, i) for i in range(next_w, m)]
        orders.append(order)
    return orders
