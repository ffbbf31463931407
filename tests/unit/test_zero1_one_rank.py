"""ZeRO-1 over one data-parallel rank (dp=1, e.g. under tp or pp) moves no gradient or parameter copies.

With one rank the shard is the whole bucket: the gradients stay in the persistent buffer autograd accumulates into
(the params' ``.grad`` are views of it, as at stage 0), and there is no reduce-scatter into a shard buffer, no
division by 1 and no post-step all-gather (each was a full copy of the local model per step). The training result
is bit-identical to the same optimizer on the plain model.
"""

from __future__ import annotations

import copy

import torch

from lightning_scale.comm import collectives as C
from lightning_scale.zero import ZeroOptimizer


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def test_stage1_one_rank_keeps_gradients_in_place_and_moves_nothing(monkeypatch):
    calls = []
    for name in ("reduce_scatter", "all_gather", "all_reduce"):
        original = getattr(C, name)
        monkeypatch.setattr(C, name, lambda *a, _n=name, _f=original, **k: (calls.append(_n), _f(*a, **k))[1])
    ref, model = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    engine = ZeroOptimizer(opt, stage=1, group=None, overlap_comm=True)
    g = torch.Generator().manual_seed(1)
    ptrs = None
    for _ in range(3):
        x = torch.randn(5, 8, generator=g)
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        grads = [p.grad for p in model.parameters()]
        assert all(gr is not None for gr in grads)  # persistent views, zeroed, like stage 0
        now = [gr.data_ptr() for gr in grads]
        assert ptrs is None or now == ptrs  # the same buffer every step: nothing reallocated or copied into
        ptrs = now
    assert calls == [], calls
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert all(st.shard_grad is None and st.grad_buffer is not None for st in engine.reducer.states)
