"""A job for tests/strategies/test_restart.py (issue 15 item 6): 8 steps of the tiny GPT at ZeRO-2 under the
diagnostics, 2 batches per epoch, a checkpoint at every epoch end (and last.ckpt), always ``fit(ckpt_path="last")``.

Launched by torchrun (or by run_script(ranks=N) for the references). ``--kill-once FILE --kill-at K``: at global step
K, rank 1 creates FILE and SIGKILLs itself, unless FILE exists (so the restart, or the next job, runs through).
``--stagger S``: on a restart, rank 1 joins S seconds after rank 0. The global batch is 8 sequences on any number of
ranks. Rank 0 appends {"attempt", "world", "start_step", "losses"} to --out as one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fit_universal  # noqa: E402,F401  (the unshuffled sampler at world size 1 too: the same batches on 1 rank)
from fit_failures import DiagStrategy  # noqa: E402
from lightning_scale.diagnostics import DiagnosticsConfig  # noqa: E402
from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule  # noqa: E402
from lightning_scale.models.gpt import gpt_tiny  # noqa: E402


class KillGPT(GPTLightningModule):
    def __init__(self, args, **kw) -> None:
        super().__init__(**kw)
        self.args, self.start_step, self.losses = args, None, {}

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step

    def training_step(self, batch, batch_idx):
        args = self.args
        if (args.kill_once and self.trainer.global_step == args.kill_at and self.global_rank == 1
                and not os.path.exists(args.kill_once)):
            open(args.kill_once, "w").close()
            if args.kill_agent:  # a lost node: its torchrun agent goes with the rank
                os.kill(os.getppid(), 9)
            os.kill(os.getpid(), 9)
        loss = super().training_step(batch, batch_idx)
        self.losses[self.trainer.global_step] = float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean"))
        return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--kill-once", default=None)
    ap.add_argument("--kill-at", type=int, default=5)
    ap.add_argument("--kill-agent", action="store_true", help="with --kill-once: SIGKILL rank 1's torchrun agent too")
    ap.add_argument("--wait-for-world", type=int, default=0,
                    help="elastic: a first attempt that met fewer ranks waits for the agent's scale-up restart")
    ap.add_argument("--format", default="sharded", help="Zero3DStrategy(checkpoint_format=...)")
    ap.add_argument("--async", dest="async_save", action="store_true", help="checkpoint_async=True")
    ap.add_argument("--top-k", type=int, default=-1, help="ModelCheckpoint(save_top_k=...)")
    ap.add_argument("--no-last", action="store_true", help="ModelCheckpoint(save_last=False)")
    ap.add_argument("--pid-dir", default=None, help="each rank writes its pid here (the test kills leftovers)")
    ap.add_argument("--stagger", type=float, default=0.0,
                    help="on a torchrun restart, rank 1 waits this long before it joins the process group")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.pid_dir:
        name = f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '-1')}-rank{os.environ.get('RANK', '0')}.pid"
        with open(os.path.join(args.pid_dir, name), "w") as f:
            f.write(str(os.getpid()))
    if world < args.wait_for_world and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        time.sleep(600)  # the rendezvous closed before every agent had joined: torchrun restarts us when they have
    if args.stagger and os.environ.get("RANK") == "1" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        time.sleep(args.stagger)  # rank 0 reaches the store's rendezvous keys first, as it may on any restart
    pl.seed_everything(0, verbose=False)
    cfg = gpt_tiny(n_layer=2, vocab_size=64, seq_len=16)
    model = KillGPT(args, model=cfg, lr=3e-3, warmup_steps=2, max_steps=8)
    data = ByteCorpusDataModule(seq_len=cfg.seq_len, batch_size=8 // world, source="random", vocab_size=64,
                                random_length=256, shuffle=False, max_bytes=2**20)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=not args.no_last, save_top_k=args.top_k,
                                        every_n_epochs=1, save_on_train_epoch_end=True)
    strategy = DiagStrategy(stage=2, checkpoint_format=args.format, checkpoint_async=args.async_save,
                            diagnostics=DiagnosticsConfig(heartbeat_interval=0.5, hang_timeout=60.0))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=8, limit_train_batches=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt],
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data, ckpt_path="last")  # no last.ckpt yet: Lightning starts from scratch
    if trainer.is_global_zero:
        with open(args.out, "a") as f:
            f.write(json.dumps({"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
                                "world": trainer.world_size, "start_step": model.start_step,
                                "global_step": trainer.global_step, "losses": model.losses}) + "\n")


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
