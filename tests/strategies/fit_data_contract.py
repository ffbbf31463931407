"""A Trainer run whose data loader may break the data contract (tp / pp peers must read the same batch).

``--shard global``: a ``DistributedSampler`` over every rank (the mistake); ``--shard dp``: over
``strategy.dp_size`` / ``strategy.dp_rank`` (the contract); ``--shard late``: the peers agree on the first
batch and differ from the third one on (only the debug mode's every-batch check sees it). Each rank writes
what it ended with (``ok`` or the exception's type and message) to ``--out-dir/rank{R}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale import Zero3DStrategy
from lightning_scale.lit import GPTLightningModule
from lightning_scale.models.gpt import gpt_tiny, make_batch


class LateSplit(torch.utils.data.Sampler):
    """Same order on every rank for the first two batches of 4, then each global rank reads its own rows."""

    def __init__(self, n: int, rank: int) -> None:
        self.n, self.rank = n, rank

    def __iter__(self):
        head = list(range(8))
        tail = [(i + 4 * self.rank) % self.n for i in range(8, self.n)]
        return iter(head + tail)

    def __len__(self) -> int:
        return self.n


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--shard", default="global", choices=("global", "dp", "late"))
    ap.add_argument("--option", action="append", default=[])
    ap.add_argument("--debug", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = gpt_tiny()
    x, y = make_batch(cfg, 32, seed=0)
    data = list(zip(x, y))
    opts = {k: int(v) for k, v in (o.split("=", 1) for o in args.option)}
    if args.debug:
        opts["debug_collectives"] = True
    strategy = Zero3DStrategy(**opts)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False)
    rank = int(os.environ.get("RANK", "0"))
    if args.shard == "global":  # the mistake: split over every rank, tp / pp peers included
        sampler = DistributedSampler(data, num_replicas=int(os.environ["WORLD_SIZE"]), rank=rank, shuffle=False)
    elif args.shard == "late":
        sampler = LateSplit(len(data), rank)
    else:  # the contract (strategy.dp_size / dp_rank exist once the process group is up: here dp = 1)
        sampler = None
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    module = GPTLightningModule(cfg, lr=1e-2, warmup_steps=1, max_steps=args.steps)
    result = {"ok": True}
    try:
        trainer.fit(module, train_dataloaders=loader)
        s = trainer.strategy
        result["dp"] = [s.dp_rank, s.dp_size, s.tp_rank, s.tp_size, s.pp_rank, s.pp_size, s.sp_rank, s.sp_size]
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        result = {"ok": False, "type": type(err).__name__, "message": str(err)}
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
