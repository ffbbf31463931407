"""torchrun --max-restarts=1 repro (issue 15 item 6, not yet a test: see the lead report): 8 steps of
the tiny GPT at ZeRO-2, 2 batches per epoch, a checkpoint at every epoch end, fit(ckpt_path="last"). With --kill-at,
rank 1 SIGKILLs itself at that global step on the first attempt only; torchrun restarts both ranks, which resume
from the last complete checkpoint. Rank 0 appends {"attempt", "final_loss", "start_step"} to --out."""

from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
import torch

from fit_failures import DiagStrategy
from lightning_scale.diagnostics import DiagnosticsConfig
from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule
from lightning_scale.models.gpt import gpt_tiny


class KillGPT(GPTLightningModule):
    def __init__(self, kill_at: int, **kw) -> None:
        super().__init__(**kw)
        self.kill_at, self.start_step, self.last_loss, self.losses = kill_at, None, None, {}

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step

    def training_step(self, batch, batch_idx):
        if (self.trainer.global_step == self.kill_at and self.global_rank == 1
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), 9)
        loss = super().training_step(batch, batch_idx)
        self.last_loss = float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean"))
        self.losses[self.trainer.global_step] = self.last_loss
        return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--kill-at", type=int, default=-1)
    args = ap.parse_args()
    pl.seed_everything(0, verbose=False)
    cfg = gpt_tiny(n_layer=2, vocab_size=64, seq_len=16)
    model = KillGPT(args.kill_at, model=cfg, lr=3e-3, warmup_steps=2, max_steps=8)
    data = ByteCorpusDataModule(seq_len=cfg.seq_len, batch_size=4, source="random", vocab_size=64,
                                random_length=256, shuffle=False, max_bytes=2**20)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=-1, every_n_epochs=1,
                                        save_on_train_epoch_end=True)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DiagStrategy(
        stage=2, diagnostics=DiagnosticsConfig(heartbeat_interval=0.5, hang_timeout=60.0)), max_steps=8,
        limit_train_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ckpt], limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data, ckpt_path="last" if os.path.exists(os.path.join(args.ckpt_dir, "last.ckpt"))
                else None)
    if trainer.is_global_zero:
        with open(args.out, "a") as f:
            f.write(json.dumps({"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                "final_loss": model.last_loss, "start_step": model.start_step,
                                "global_step": trainer.global_step, "losses": model.losses}) + "\n")


if __name__ == "__main__":
    main()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
