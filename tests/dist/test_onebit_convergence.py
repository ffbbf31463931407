"""Convergence: OneBitAdam vs AdamW on the project GPT, dp = 2 on gloo, real text, fixed budget.

Both runs see the same seed, batches and learning-rate schedule; the AdamW run all-reduces its
gradients through the same accounting layer, so the bytes of the two runs compare directly.
freeze_step is 20% of the steps, the top of the 15-20% range the paper uses. The budget matters:
with 300 steps (freeze 60) the gap to AdamW was 4.4%, because this small model's attention
gradients still grow after the freeze and the frozen variance cannot follow (docs/onebit_adam.md).
"""

import math

import pytest
import torch

from lightning_scale.comm import CommCounter, all_reduce
from lightning_scale.data import split, stdlib_corpus
from lightning_scale.models.gpt import GPT, GPTConfig
from lightning_scale.optim import OneBitAdam
from lightning_scale.testing import run_distributed

STEPS, FREEZE, LR = 600, 120, 3e-3
BATCH, SEQ = 8, 64  # per rank (16 x 64 until 2026-12-07: the same verdict, -2.2% vs -1.1%, in 1.5x the time)
CFG = dict(vocab_size=256, seq_len=SEQ, n_layer=2, n_head=4, d_model=64)


def _windows(data, n, seed):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - SEQ - 1, (n,), generator=g)
    rows = torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def _lr(step):
    return LR * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / STEPS))


def _train(rank, world, name, train, val):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    if name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.01)
    else:
        opt = OneBitAdam(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.01, freeze_step=FREEZE)
    with CommCounter() as counter:
        for step in range(STEPS):
            for group in opt.param_groups:
                group["lr"] = _lr(step)
            x, y = _windows(train, BATCH, seed=1000 * step + rank)
            opt.zero_grad()
            model.loss(x, y).backward()
            if name == "adamw":  # what DDP does, through the accounting layer
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                all_reduce(flat, tag="adamw")
                for p, g in zip(model.parameters(), flat.div_(world).split([p.numel() for p in model.parameters()])):
                    p.grad.copy_(g.view_as(p))
            opt.step()
    with torch.no_grad():
        x, y = _windows(val, 256, seed=12345)
        val_loss = sum(model.loss(x[i:i + 64], y[i:i + 64]).item() for i in range(0, 256, 64)) / 4
    return val_loss, counter.total


def _both(rank, world):
    train, val = split(stdlib_corpus(2 * 2**20), val_fraction=0.1)
    return {name: _train(rank, world, name, train, val) for name in ("adamw", "onebit")}


@pytest.mark.slow
def test_onebit_adam_converges_like_adamw():
    results = run_distributed(_both, 2, timeout=600)
    (adamw_val, adamw_bytes), (onebit_val, onebit_bytes) = results[0]["adamw"], results[0]["onebit"]
    print(f"val loss AdamW {adamw_val:.4f}  OneBitAdam {onebit_val:.4f}  ratio {onebit_val / adamw_val:.4f}; "
          f"bytes AdamW/OneBitAdam {adamw_bytes / onebit_bytes:.2f}x")
    assert adamw_val < 3.5  # it learned: a uniform byte model scores ln(256) = 5.55
    assert onebit_val <= 1.03 * adamw_val
    assert adamw_bytes / onebit_bytes >= 4.0  # ~4.3x over the whole run (20% warm-up, then ~1/30)
