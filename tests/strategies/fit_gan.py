"""A GAN with two optimizers and manual optimization, as a script: the final parameters go to --out (rank 0)."""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_scale  # noqa: F401


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        self.toggle_optimizer(opt_g)
        fake = self.generator(noise)
        g_loss = bce(self.discriminator(fake), torch.ones(len(fake), 1))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = bce(self.discriminator(real), torch.ones(len(real), 1)) + \
            bce(self.discriminator(fake.detach()), torch.zeros(len(fake), 1))
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-2, betas=(0.5, 0.9)),
                torch.optim.SGD(self.discriminator.parameters(), lr=5e-2, momentum=0.9))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=g) + 2, torch.randn(64, 4, generator=g))
        sampler = None
        if self.trainer.world_size > 1:
            sampler = DistributedSampler(data, shuffle=False, **self.trainer.distributed_sampler_kwargs)
        return DataLoader(data, batch_size=16 // self.trainer.world_size, sampler=sampler, shuffle=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="zero2")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    pl.seed_everything(0, verbose=False)
    model = GAN()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices,
                         strategy="auto" if args.strategy == "single" else args.strategy, max_steps=6,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model)
    if trainer.is_global_zero:
        torch.save({n: p.detach().double().clone() for n, p in model.named_parameters()}, args.out)


if __name__ == "__main__":
    main()
