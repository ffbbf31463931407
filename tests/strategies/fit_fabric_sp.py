"""Fabric loops under Ulysses sequence parallelism (Zero3DFabricStrategy(sp=2)), launched by
tests/strategies/test_sp_trainer.py. The project GPT in float64, fit_fabric.py's steps (2 micro-batches each, the
first under ``fabric.no_backward_sync``, clipping 0.5, AdamW with two groups), its loss the model's own
``model.loss`` (the whole-sequence mean under sp). Batches reach each rank two ways: ``fabric.setup_dataloaders``
(the strategy cuts each batch to this rank's slice) or ``fabric.strategy.shard_batch`` in a loop that builds them.
"""

from __future__ import annotations

import argparse
import ast
import json

import torch
from torch.utils.data import DataLoader, TensorDataset

from fit_fabric import BATCH, CLIP, MICRO, STEPS, _fabric, _full, _setup, batches


def _loader(fabric):
    """Every micro-batch of every step in order, one loader batch each (dp = 1: the sampler keeps them all)."""
    xs, ys = zip(*(b for step in range(STEPS) for b in batches(step)))
    return fabric.setup_dataloaders(DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=BATCH))


def run(layouts, devices: int) -> dict:
    out = {}
    for name, kw, via in layouts:
        fabric = _fabric(kw, devices)
        model, opt = _setup(fabric)
        strategy = fabric.strategy
        dp, r = strategy.dp_size, strategy.dp_rank
        drawn = iter(_loader(fabric)) if via == "loader" else None
        losses, norms, widths = [], [], set()
        for step in range(STEPS):
            total = 0.0
            for m, (x, y) in enumerate(batches(step)):
                if drawn is not None:
                    x, y = next(drawn)
                else:
                    x, y = strategy.shard_batch((x.chunk(dp)[r], y.chunk(dp)[r]))
                widths.add(x.shape[1])
                with fabric.no_backward_sync(model, enabled=m < MICRO - 1):
                    loss = model.loss(x, y) / MICRO
                    fabric.backward(loss)
                total += float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=CLIP)))
            opt.step()
            opt.zero_grad()
            losses.append(total)
        final = _full(fabric)
        out[name] = {"losses": losses, "norms": norms, "widths": sorted(widths), "sp": strategy.sp_size,
                     "state": {k: v.tolist() for k, v in final.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--layouts", required=True, help="python literal: [(name, kwargs, 'loader' | 'shard'), ...]")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    result = run(ast.literal_eval(args.layouts), args.devices)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
