"""A Trainer run of the project GPT (or, ``--llama``, a Hugging Face Llama) with Zero3DStrategy(autotune=...) or a layout set by hand (the autotune tests).

Writes, on rank 0, the all-rank mean loss of every step, the strategy's autotune_result and the layout it trained
with as JSON to --out; a ConfigError is written there as {"error": ...} by every rank that raised it (rank files).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import time

import lightning.pytorch as pl
import torch

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale import Zero3DStrategy
from lightning_scale.config import ConfigError
from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule
from lightning_scale.models.gpt import gpt_tiny
from fit_gpt import LossRecorder

_COPIES = itertools.count()  # the probes' deep copies of the module, in order (the module trained last)


def failing_probes(cls, rank: int, probes: str):
    """``cls`` whose ``training_step`` raises on ``rank`` only, in the first probe (``probes="first"``) or in every
    probe (``"all"``): after 2 s, so the other ranks are inside the step's collectives by then."""

    class FailingProbes(cls):
        original = None  # the module trained after the search (set by main; a class attribute: not deep-copied)

        def training_step(self, batch, batch_idx):
            if "_copy_no" not in self.__dict__:
                self._copy_no = next(_COPIES)  # set on the copy: each probe's deepcopy of the original is new
            if self is not FailingProbes.original and self.trainer.global_rank == rank and (
                    probes == "all" or self._copy_no == 0):
                time.sleep(2.0)
                raise RuntimeError(f"injected failure on rank {rank} (probe copy {self._copy_no})")
            return super().training_step(batch, batch_idx)

    return FailingProbes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="per data-parallel rank")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--llama", action="store_true", help="a Hugging Face LlamaForCausalLM (tune_llama_module)")
    ap.add_argument("--mixtral", action="store_true", help="a Hugging Face MixtralForCausalLM, 4 experts, top-2")
    ap.add_argument("--option", action="append", default=[], help="strategy option k=v (Python literal)")
    ap.add_argument("--fail-rank", type=int, default=None, help="training_step raises on this rank in --fail-probes")
    ap.add_argument("--fail-probes", default="first", choices=("first", "all"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-dir", default=None, help="save a checkpoint at the end of every epoch here")
    ap.add_argument("--epoch-batches", type=int, default=None, help="limit_train_batches (steps per epoch)")
    ap.add_argument("--resume", default=None, help="fit(ckpt_path=...)")
    args = ap.parse_args()
    pl.seed_everything(0, verbose=False)
    cfg = gpt_tiny(n_layer=args.layers, vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model)
    if args.llama or args.mixtral:
        from tune_llama_module import TinyLlama, TinyMixtral

        model = (TinyMixtral if args.mixtral else TinyLlama)(vocab_size=args.vocab, num_hidden_layers=args.layers, hidden_size=args.d_model,
                          intermediate_size=2 * args.d_model, max_position_embeddings=max(64, args.seq_len))
    else:
        cls = GPTLightningModule if args.fail_rank is None else failing_probes(GPTLightningModule, args.fail_rank,
                                                                              args.fail_probes)
        model = cls(model=cfg, lr=3e-3, warmup_steps=2, max_steps=args.steps)
        if args.fail_rank is not None:
            cls.original = model
    opts = {}
    for item in args.option:
        k, v = item.split("=", 1)
        try:
            v = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            pass
        opts[k] = v
    data = ByteCorpusDataModule(seq_len=cfg.seq_len, batch_size=args.batch, source="random",
                                vocab_size=cfg.vocab_size, random_length=256, shuffle=False, max_bytes=2**20)
    strategy = Zero3DStrategy(**opts)
    recorder = LossRecorder()
    callbacks = [recorder]
    if args.ckpt_dir:
        # at epoch ends: a mid-epoch resume would read the epoch's batches from its start again
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_epochs=1, save_top_k=-1,
                                                      save_on_train_epoch_end=True))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision,
                         max_steps=args.steps, logger=False, enable_checkpointing=bool(args.ckpt_dir),
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         limit_val_batches=0, num_sanity_val_steps=0, limit_train_batches=args.epoch_batches)
    try:
        trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    except ConfigError as err:
        with open(f"{args.out}.rank{trainer.global_rank}", "w") as f:
            json.dump({"error": str(err)}, f)
        raise
    if trainer.is_global_zero:
        c = strategy.config
        with open(args.out, "w") as f:
            json.dump({"losses": recorder.losses, "autotune": strategy.autotune_result,
                       "layout": {"stage": c.zero.stage, "offload": [c.offload.optimizer, c.offload.params],
                                  "dp": strategy.topology.dp, "tp": c.tp, "pp": c.pp,
                                  "microbatches": c.pipeline.microbatches, "bucket_mb": c.zero.bucket_mb,
                                  "ac": c.activation_checkpointing, "sp": strategy.topology.sp, "ep": c.ep,
                                  "tiled_mlp": c.tiled_mlp, "tiled_attention": c.tiled_attention,
                                  "offload_activations": c.offload_activations},
                       "checkpoint_format": c.checkpoint_format, "global_step": trainer.global_step}, f, default=str)


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
