"""Fine-tune a local Hugging Face checkpoint with a real Trainer; write the per-step losses as JSON.

The LightningModule is what a user writes for one device: ``configure_model`` calls
``AutoModelForCausalLM.from_pretrained(directory)``, nothing else. Under ``Zero3DStrategy(stage=3)`` / ``tp=2`` /
``pp=2`` that runs on the meta device, where the call builds the model from the directory's config and records the
directory; ``setup`` then reads each rank's shard / slices / stage from the safetensors files
(``lightning_scale.pretrained``). ``--strategy single`` is the reference: transformers' own ``from_pretrained``.
``--fabric``: the same under Lightning Fabric, ``from_pretrained`` inside ``fabric.init_module(empty_init=True)``.
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


def fabric_losses(args, opts: dict) -> dict:
    """The same fine-tuning as a Fabric loop: ``AutoModelForCausalLM.from_pretrained`` inside
    ``fabric.init_module(empty_init=True)`` (the meta device under ZeRO-3 / tp), then ``fabric.setup``."""
    from lightning.fabric import Fabric
    from transformers import AutoModelForCausalLM

    from lightning_scale.pretrained import SOURCE_ATTR
    from lightning_scale.strategies import Zero3DFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=Zero3DFabricStrategy(**opts),
                    precision=args.precision)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_pretrained(args.dir)
    recorded, meta, dtype = hasattr(model, SOURCE_ATTR), next(model.parameters()).is_meta, model.dtype
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = fabric.setup(model, opt)
    losses = []
    for x, y in _rows(args.steps):  # every rank trains on every row: the dp mean is one process's
        loss = lm_loss(model(input_ids=x).logits, y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    return {"losses": losses, "world": fabric.world_size, "recorded": recorded, "meta": meta, "dtype": str(dtype),
            "rank": fabric.global_rank}


def _rows(steps: int):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (steps * 4, 13), generator=g)
    return torch.utils.data.DataLoader(list(zip(ids[:, :-1], ids[:, 1:])), batch_size=4)


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--strategy", default="zero3d")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--option", action="append", default=[])
    ap.add_argument("--fabric", action="store_true", help="a Fabric loop on Zero3DFabricStrategy instead")
    ap.add_argument("--precision", default="32-true")
    args = ap.parse_args()
    data = _rows(args.steps)
    opts = {k: int(v) for k, v in (o.split("=", 1) for o in args.option)}
    if args.fabric:
        res = fabric_losses(args, opts)
        if res["rank"] == 0:
            with open(args.out, "w") as f:
                json.dump(res, f)
        return
    strategy = "auto" if args.strategy == "single" else Zero3DStrategy(**opts)
    rec = Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         precision=args.precision,
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
