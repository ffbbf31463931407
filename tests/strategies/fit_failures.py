"""A Trainer run of the tiny GPT with an injected fault, for tests/strategies/test_failures.py.

The strategy is a test-only subclass of Zero3DStrategy that calls the diagnostics glue the way the lead wires
it (install at the end of setup, teardown at the end of teardown). Each rank writes its pid to --pid-dir when
training starts and a line per finished batch to rank<r>.steps, so the test can check that no process is
left and send signals mid-run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch

import lightning_scale  # noqa: F401
from lightning_scale import Zero3DStrategy
from lightning_scale.diagnostics import DiagnosticsConfig
from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule
from lightning_scale.models.gpt import gpt_tiny
from lightning_scale.strategies import diagnostics_glue

MODES = {"zero2": dict(stage=2), "zero3": dict(stage=3), "pp2": dict(stage=1, pp=2, microbatches=2),
         "tp2": dict(stage=1, tp=2)}


class DiagStrategy(Zero3DStrategy):
    def __init__(self, *args, diagnostics: DiagnosticsConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._diag_config = diagnostics

    def setup(self, trainer) -> None:
        super().setup(trainer)
        diagnostics_glue.install(self, trainer, self._diag_config)

    def teardown(self) -> None:
        super().teardown()
        diagnostics_glue.teardown(self)


def inject(args, rank: int, batch_idx: int) -> None:
    if rank != args.fault_rank or batch_idx != args.fault_step:
        return
    if args.fault == "hang":
        time.sleep(600)  # the stuck rank
    elif args.fault == "raise":
        raise RuntimeError("boom: injected failure in training_step")
    elif args.fault == "sigkill":
        os.kill(os.getpid(), 9)


class FaultGPT(GPTLightningModule):
    def __init__(self, args, **kw) -> None:
        super().__init__(**kw)
        self.args = args

    def training_step(self, batch, batch_idx):
        inject(self.args, self.global_rank, batch_idx)  # zero2 / zero3 / tp: inside training_step
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)
        return super().training_step(batch, batch_idx)


class Marks(pl.Callback):
    def __init__(self, args) -> None:
        self.args = args

    def on_train_start(self, trainer, pl_module) -> None:
        with open(os.path.join(self.args.pid_dir, f"rank{trainer.global_rank}.pid"), "w") as f:
            f.write(str(os.getpid()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.args.mode == "pp2":  # the pipeline schedule replaces training_step: inject before it
            inject(self.args, trainer.global_rank, batch_idx)
            if self.args.step_sleep:
                time.sleep(self.args.step_sleep)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open(os.path.join(self.args.pid_dir, f"rank{trainer.global_rank}.steps"), "a") as f:
            f.write(f"{batch_idx}\n")


class WeightNorms(pl.Callback):
    """The docs/failures.md pattern: weight norms between steps (at ZeRO-3 inside diagnostics_glue.gathered)."""

    def __init__(self, args) -> None:
        self.args = args

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rank = trainer.global_rank
        if batch_idx == 0:  # a bare read of a sharded parameter: a clear error, not a segfault
            try:
                next(pl_module.model.blocks[0].parameters()).norm()
                text = "no error"
            except Exception as err:  # noqa: BLE001
                text = f"{type(err).__name__}: {err}"
            with open(os.path.join(self.args.pid_dir, f"norm_error{rank}.txt"), "w") as f:
                f.write(text)
        with diagnostics_glue.gathered(trainer.strategy, pl_module):
            norms = {n: float(p.norm()) for n, p in pl_module.named_parameters()}
        with open(os.path.join(self.args.pid_dir, f"norms{rank}.jsonl"), "a") as f:
            f.write(json.dumps(norms) + "\n")


class FailingTeardown(pl.Callback):
    """--teardown-faults: secondary errors after the first one. on_exception enters a collective whose peer is gone
    (or going: its watchdog ends it on the published error), then raises; the strategy's own teardown fails too."""

    def __init__(self, args) -> None:
        self.args = args

    def on_train_start(self, trainer, pl_module) -> None:
        def broken_remove_hooks():
            raise OSError("injected secondary: remove_hooks failed in teardown")

        trainer.strategy.engines[0].remove_hooks = broken_remove_hooks

    def on_exception(self, trainer, pl_module, exception) -> None:
        try:
            torch.distributed.barrier()  # the peer is blocked in another collective, then gone
            text = "barrier returned"
        except Exception as err:  # noqa: BLE001 - record it, then fail differently
            text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        with open(os.path.join(self.args.pid_dir, f"barrier{trainer.global_rank}.txt"), "w") as f:
            f.write(text)
        if trainer.global_rank == 0:  # a slow teardown: rank 1 has exited (EXIT_PEER_FAILED) long before
            time.sleep(self.args.teardown_delay)
        raise ValueError(f"injected secondary: on_exception failed after the barrier ({text})")


def _observe_often() -> None:
    """Lightning's child-process observer (rank 0, under its launcher) looks at the children every 5 s; here every
    0.2 s, so a race it would win against rank 0's own report shows in every run, not one in many."""
    from lightning.fabric.strategies.launchers import subprocess_script

    init = subprocess_script._ChildProcessObserver.__init__
    assert init.__defaults__ == (5,), init.__defaults__  # the period this relies on: Lightning changed it
    init.__defaults__ = (0.2,)


def main() -> None:
    _observe_often()
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="zero2", choices=sorted(MODES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fault", default="none", choices=["none", "hang", "raise", "sigkill"])
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=2)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--hang-timeout", type=float, default=5.0)
    ap.add_argument("--save-on-preempt", action="store_true")
    ap.add_argument("--pid-dir", required=True)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--norms", action="store_true", help="log weight norms between steps (WeightNorms)")
    ap.add_argument("--teardown-faults", action="store_true", help="secondary errors after the first (FailingTeardown)")
    ap.add_argument("--teardown-delay", type=float, default=0.0, help="seconds rank 0's failing on_exception takes")
    args = ap.parse_args()

    pl.seed_everything(0, verbose=False)
    cfg = gpt_tiny(n_layer=2, vocab_size=64, seq_len=16)
    model = FaultGPT(args, model=cfg, lr=3e-3, warmup_steps=2, max_steps=args.steps)
    diag = DiagnosticsConfig(hang_timeout=args.hang_timeout, first_step_grace=20.0, heartbeat_interval=0.5,
                             stop_timeout=20.0, save_on_preempt=args.save_on_preempt)
    per_rank = 8 if args.mode in ("pp2", "tp2") else 4
    data = ByteCorpusDataModule(seq_len=cfg.seq_len, batch_size=per_rank, source="random", vocab_size=64,
                                random_length=256, shuffle=False, max_bytes=2**20)
    callbacks = [Marks(args)] + ([WeightNorms(args)] if args.norms else [])
    callbacks += [FailingTeardown(args)] if args.teardown_faults else []
    if args.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1, every_n_train_steps=2))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DiagStrategy(diagnostics=diag, **MODES[args.mode]),
                         max_steps=args.steps, logger=False, enable_checkpointing=bool(args.ckpt_dir),
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         limit_val_batches=0, num_sanity_val_steps=0)
    try:
        trainer.fit(model, datamodule=data)
    except BaseException as exc:  # the error fit raised on this rank, for the test (re-raised: the exit stays)
        with open(os.path.join(args.pid_dir, f"final{trainer.global_rank}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise
    if args.out and trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump({"global_step": trainer.global_step}, f)


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
