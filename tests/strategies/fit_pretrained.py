"""Fine-tune a local Hugging Face checkpoint with a real Trainer; write the per-step losses as JSON.

The LightningModule is what a user writes for one device: ``configure_model`` calls
``AutoModelForCausalLM.from_pretrained(directory)``, nothing else. Under ``Zero3DStrategy(stage=3)`` / ``tp=2`` /
``pp=2`` that runs on the meta device, where the call builds the model from the directory's config and records the
directory; ``setup`` then reads each rank's shard / slices / stage from the safetensors files
(``lightning_scale.pretrained``). ``--strategy single`` is the reference: transformers' own ``from_pretrained``.
"""

from __future__ import annotations

import argparse
import json
import warnings

import lightning.pytorch as pl
import torch
from fit_hf import Losses  # the same per-step loss recorder as the unchanged-model runs

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale import Zero3DStrategy
from lightning_scale.models.gpt import lm_loss


class Finetune(pl.LightningModule):
    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(self.directory)

    def training_step(self, batch, batch_idx):  # not called under pp: the strategy runs the schedule
        x, y = batch
        loss = lm_loss(self.model(input_ids=x).logits, y)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--strategy", default="zero3d")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--option", action="append", default=[])
    args = ap.parse_args()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (args.steps * 4, 13), generator=g)
    data = torch.utils.data.DataLoader(list(zip(ids[:, :-1], ids[:, 1:])), batch_size=4)
    opts = {k: int(v) for k, v in (o.split("=", 1) for o in args.option)}
    strategy = "auto" if args.strategy == "single" else Zero3DStrategy(**opts)
    rec = Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[rec], num_sanity_val_steps=0,
                         use_distributed_sampler=False)  # every rank trains on every row: the dp mean is one process's
    module = Finetune(args.dir)
    trainer.fit(module, train_dataloaders=data)
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump({"losses": rec.losses, "world": trainer.world_size,  # built on meta: the source recorded
                       "recorded": hasattr(module.model, "_lightning_scale_weights")}, f)


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
