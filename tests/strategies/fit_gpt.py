"""A Trainer run of the project GPT, launched as a script by the strategy tests (Lightning re-launches it per rank).

Writes the all-rank mean training loss of every micro-batch (and a few facts) as JSON to --out on rank 0.
"""

from __future__ import annotations

import argparse
import ast
import json

import lightning.pytorch as pl
import torch

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale import Zero3DStrategy
from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule
from lightning_scale.models.gpt import gpt_tiny


class LossRecorder(pl.Callback):
    def __init__(self, record_batches: bool = False) -> None:
        self.losses = []
        self.record_batches = record_batches
        self.batch_sums = []  # per micro-batch: every rank's sum of its input tokens (which batch it read)
        self.logged = []  # per micro-batch: every rank's logged train_loss
        self.lrs = []  # per micro-batch: the lr of the user's optimizer's first group (what its scheduler set)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float().clone() if isinstance(outputs, dict) else outputs.detach().float()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
        if self.record_batches and trainer.world_size > 1:
            mine = batch[0].double().sum().reshape(1)
            every = [torch.zeros_like(mine) for _ in range(trainer.world_size)]
            torch.distributed.all_gather(every, mine)
            self.batch_sums.append([float(t) for t in every])
            logged = trainer.callback_metrics["train_loss"].detach().double().reshape(1)  # what self.log saw here
            every = [torch.zeros_like(logged) for _ in range(trainer.world_size)]
            torch.distributed.all_gather(every, logged)
            self.logged.append([float(t) for t in every])


class MissingParamGPT(GPTLightningModule):
    def configure_optimizers(self):
        params = [p for n, p in self.model.named_parameters() if not n.startswith("ln_f")]
        return torch.optim.AdamW(params, lr=self.lr)


class NoLayersGPT(GPTLightningModule):
    pipeline_layers = None  # exposes no layer sequence for pipeline parallelism

    def configure_model(self) -> None:
        super().configure_model()
        self.model.pipeline_layers = None  # nor does the GPT inside (layer discovery searches submodules)


class FailingGPT(GPTLightningModule):
    def __init__(self, fail_rank: int, **kw) -> None:
        super().__init__(**kw)
        self.fail_rank = fail_rank

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == self.fail_rank:
            raise RuntimeError("boom: injected failure in training_step")
        return super().training_step(batch, batch_idx)


def _p2p_info(strategy):
    """How the pipeline's point-to-point went (None without a pipeline): NCCL emulated, through the direction twin."""
    glue = getattr(strategy, "_pipeline", None)
    p2p = glue.runtime.p2p if glue is not None else None
    return None if p2p is None else {"emulated": p2p.emulate, "twin": p2p.reverse_group is not None,
                                     "pairs": p2p.pair_groups is not None}


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
    ap.add_argument("--save-last", action="store_true", help="with --ckpt-dir: also last.ckpt, rewritten every epoch")
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--source", default="random")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--epoch-batches", type=int, default=None, help="limit_train_batches (micro-batches per epoch)")
    ap.add_argument("--missing-param", action="store_true")
    ap.add_argument("--sparse", action="store_true", help="block-sparse (BSLongformer) attention")
    ap.add_argument("--probe", action="store_true",
                    help="after fit, every rank computes the loss of a fixed batch; rank 0 reports it")
    ap.add_argument("--option", action="append", default=[], help="strategy option k=v (int/float/str)")
    ap.add_argument("--state-dict-out", default=None, help="save the consolidated model state_dict here (rank 0)")
    ap.add_argument("--no-predict", action="store_true")
    ap.add_argument("--no-layers", action="store_true", help="a module without pipeline_layers()")
    ap.add_argument("--tie", action="store_true", help="tie the embedding and the LM head")
    ap.add_argument("--test-ckpt", default=None, help="also run trainer.test(ckpt_path=...) after fit")
    ap.add_argument("--validate-ckpt", default=None,
                    help="no fit: only trainer.validate(ckpt_path=...) on this fresh strategy (no engines exist); "
                         "'none': without a checkpoint")
    ap.add_argument("--record-batches", action="store_true", help="record which batch each rank read")
    ap.add_argument("--optimizer", default="adamw", help="GPTLightningModule optimizer: adamw, onebit_adam, sgd")
    ap.add_argument("--freeze-step", type=int, default=None, help="OneBitAdam warm-up steps")
    args = ap.parse_args()

    pl.seed_everything(0, verbose=False)
    vocab = 256 if args.source == "stdlib" else 64
    cfg = gpt_tiny(n_layer=args.layers, vocab_size=vocab, seq_len=args.seq_len, tie_weights=args.tie)
    kw = dict(model=cfg, lr=3e-3, warmup_steps=2, max_steps=args.steps)
    if args.optimizer != "adamw":
        kw.update(optimizer=args.optimizer, freeze_step=args.freeze_step)
    if args.sparse:
        from lightning_scale.nn import BSLongformerSparsityConfig

        kw["attention"] = BSLongformerSparsityConfig(num_heads=cfg.n_head, block=16, num_sliding_window_blocks=3,
                                                     attention="unidirectional")
    if args.fail_rank >= 0:
        model = FailingGPT(args.fail_rank, **kw)
    elif args.missing_param:
        model = MissingParamGPT(**kw)
    elif args.no_layers:
        model = NoLayersGPT(**kw)
    else:
        model = GPTLightningModule(**kw)
    opts = {}
    for item in args.option:
        k, v = item.split("=", 1)
        for cast in (int, float, ast.literal_eval):  # literal_eval: dicts such as plan={...}
            try:
                v = cast(v)
                break
            except (ValueError, SyntaxError):
                pass
        opts[k] = v
    model_parallel = opts.get("tp", 1) * opts.get("pp", 1) * opts.get("sp", 1)
    # tp / pp / sp peers read the same batch: the global batch splits over the data-parallel ranks only
    per_rank = args.global_batch // max(1, args.devices // model_parallel)
    data = ByteCorpusDataModule(seq_len=cfg.seq_len, batch_size=per_rank, source=args.source,
                                vocab_size=cfg.vocab_size, random_length=256, shuffle=False, max_bytes=2**20)
    if args.strategy == "single":
        strategy = "auto"
    elif args.option:
        strategy = Zero3DStrategy(**opts)
    else:
        strategy = args.strategy
    recorder = LossRecorder(record_batches=args.record_batches)
    callbacks = [recorder]
    if args.ckpt_dir and args.save_last:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=-1,
                                                      every_n_epochs=1, save_on_train_epoch_end=True))
    elif args.ckpt_dir:
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
    if args.validate_ckpt:
        ckpt = None if args.validate_ckpt == "none" else args.validate_ckpt  # "none": the fresh init
        val = trainer.validate(model, datamodule=data, verbose=False, ckpt_path=ckpt)
        if trainer.is_global_zero:
            with open(args.out, "w") as f:
                json.dump({"val": val, "world": trainer.world_size, "sharded": trainer.strategy.sharded is not None
                           if hasattr(trainer.strategy, "sharded") else False}, f)
        return
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    probe = None
    if args.probe:  # the trained (possibly sharded) model on a fixed batch; a collective under ZeRO-3 / tp / pp
        from lightning_scale.models.gpt import make_batch

        x, y = make_batch(cfg, 2, seed=123)
        with torch.no_grad():
            probe = float(model.model.loss(x, y))
    val = trainer.validate(model, datamodule=data, verbose=False)
    test = trainer.test(model, datamodule=data, verbose=False)
    if args.test_ckpt:  # load a checkpoint into the model as it is now (already split under tp / pp)
        test.append(trainer.test(model, datamodule=data, verbose=False, ckpt_path=args.test_ckpt)[0])
    predictions = [] if args.no_predict else trainer.predict(model, datamodule=data)
    if args.state_dict_out:
        if getattr(trainer.strategy, "sharded", None) is not None:  # ZeRO-3: gather the shards (collective)
            state = trainer.strategy.full_state_dict()
        else:
            state = trainer.strategy.lightning_module_state_dict()  # collective under tp / pp
        if trainer.is_global_zero:
            torch.save({k: v.detach().cpu() for k, v in state.items()}, args.state_dict_out)
    held = [sum(p.numel() for p in model.parameters())]  # parameter elements this rank holds
    if trainer.world_size > 1:
        held = [None] * trainer.world_size
        torch.distributed.all_gather_object(held, sum(p.numel() for p in model.parameters()))
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump({"losses": recorder.losses, "val": val, "test": test, "n_predict": len(predictions),
                       "pred0": predictions[0][0].tolist() if predictions else None,
                       "batch_sums": recorder.batch_sums, "logged": recorder.logged, "lrs": recorder.lrs, "held": held, "probe": probe,
                   "world": trainer.world_size,
                   "compile": getattr(trainer.strategy, "compile_report", None),  # compile_glue's numbers
                   "cores": sorted({type(b.attn.core).__name__ for b in model.model.blocks}),
                       "precision": str(trainer.precision),
                       "engines": [type(e).__name__ for e in getattr(trainer.strategy, "engines", [])],
                       "p2p": _p2p_info(trainer.strategy)}, f)


if __name__ == "__main__":
    main()
    # Tear the process group down explicitly: leaving gloo's threads to interpreter exit occasionally aborted a
    # rank ("terminate called without an active exception") after all work was done.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
