"""A Trainer run of the project GPT, launched as a script by the strategy tests (Lightning re-launches it per rank).

Writes the all-rank mean training loss of every micro-batch (and a few facts) as JSON to --out on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
import torch

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale import Zero3DStrategy
from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule
from lightning_scale.models.gpt import gpt_tiny


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float().clone() if isinstance(outputs, dict) else outputs.detach().float()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))


class MissingParamGPT(GPTLightningModule):
    def configure_optimizers(self):
        params = [p for n, p in self.model.named_parameters() if not n.startswith("ln_f")]
        return torch.optim.AdamW(params, lr=self.lr)


class FailingGPT(GPTLightningModule):
    def __init__(self, fail_rank: int, **kw) -> None:
        super().__init__(**kw)
        self.fail_rank = fail_rank

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == self.fail_rank:
            raise RuntimeError("boom: injected failure in training_step")
        return super().training_step(batch, batch_idx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="zero2")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--clip-algorithm", default="norm")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--source", default="random")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--epoch-batches", type=int, default=None, help="limit_train_batches (micro-batches per epoch)")
    ap.add_argument("--missing-param", action="store_true")
    ap.add_argument("--sparse", action="store_true", help="block-sparse (BSLongformer) attention")
    ap.add_argument("--option", action="append", default=[], help="strategy option k=v (int/float/str)")
    args = ap.parse_args()

    pl.seed_everything(0, verbose=False)
    vocab = 256 if args.source == "stdlib" else 64
    cfg = gpt_tiny(n_layer=args.layers, vocab_size=vocab, seq_len=args.seq_len)
    kw = dict(model=cfg, lr=3e-3, warmup_steps=2, max_steps=args.steps)
    if args.sparse:
        from lightning_scale.nn import BSLongformerSparsityConfig

        kw["attention"] = BSLongformerSparsityConfig(num_heads=cfg.n_head, block=16, num_sliding_window_blocks=3,
                                                     attention="unidirectional")
    if args.fail_rank >= 0:
        model = FailingGPT(args.fail_rank, **kw)
    elif args.missing_param:
        model = MissingParamGPT(**kw)
    else:
        model = GPTLightningModule(**kw)
    per_rank = args.global_batch // args.devices
    data = ByteCorpusDataModule(seq_len=cfg.seq_len, batch_size=per_rank, source=args.source,
                                vocab_size=cfg.vocab_size, random_length=256, shuffle=False, max_bytes=2**20)
    if args.strategy == "single":
        strategy = "auto"
    elif args.option:
        opts = {}
        for item in args.option:
            k, v = item.split("=", 1)
            for cast in (int, float):
                try:
                    v = cast(v)
                    break
                except ValueError:
                    pass
            opts[k] = v
        strategy = Zero3DStrategy(**opts)
    else:
        strategy = args.strategy
    recorder = LossRecorder()
    callbacks = [recorder]
    if args.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1, every_n_epochs=1,
                                                      save_on_train_epoch_end=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision,
        max_steps=args.steps, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip or None, gradient_clip_algorithm=args.clip_algorithm,
        logger=False, enable_checkpointing=bool(args.ckpt_dir), enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, limit_val_batches=2, val_check_interval=2,
        num_sanity_val_steps=0, limit_train_batches=args.epoch_batches,
    )
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    val = trainer.validate(model, datamodule=data, verbose=False)
    test = trainer.test(model, datamodule=data, verbose=False)
    predictions = trainer.predict(model, datamodule=data)
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump({"losses": recorder.losses, "val": val, "test": test, "n_predict": len(predictions),
                   "world": trainer.world_size,
                   "cores": sorted({type(b.attn.core).__name__ for b in model.model.blocks}),
                       "precision": str(trainer.precision)}, f)


if __name__ == "__main__":
    main()
