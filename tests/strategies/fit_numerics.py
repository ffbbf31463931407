"""Several short 2-rank Trainer fits in one launch, each with injected bad numerics (tests/strategies/test_numerics.py).

Writes one JSON record per case on rank 0: the logged loss_scale / skipped_steps / nonfinite_steps, the lr and the
scheduler's count after each batch, whether the weights stayed finite, and the NumericsError message if one was
raised (on every rank at the same step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import lightning.pytorch as pl
import torch

import lightning_scale  # noqa: F401
from lightning_scale.config import LossScaleConfig
from lightning_scale.diagnostics import DiagnosticsConfig
from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule
from lightning_scale.models.gpt import gpt_tiny
from lightning_scale.zero.precision import NumericsError

from fit_failures import DiagStrategy

CASES = {  # name: precision, batches that get a bad loss, on which ranks, the bad value, steps, knobs
    "fp32_nan_once": dict(precision="32-true", bad=[2], ranks=[1], value=float("nan"), steps=5),
    "bf16_nan_streak": dict(precision="bf16-mixed", bad=list(range(1, 99)), ranks=[0, 1], value=float("nan"), steps=8,
                            diag=dict(max_nonfinite_steps=3)),
    "fp16_absurd_scale": dict(precision="16-mixed", bad=[], ranks=[], value=0.0, steps=6,
                              scale=dict(initial_scale=2.0**40, backoff_factor=2.0**-8)),
    # docs/failures.md recipe: the scheduler holds on skipped steps (lr_scheduler_step reads last_step_skipped)
    "fp16_absurd_scale_hold": dict(precision="16-mixed", bad=[], ranks=[], value=0.0, steps=6, hold=True,
                                   scale=dict(initial_scale=2.0**40, backoff_factor=2.0**-8)),
    "fp16_pinned_min": dict(precision="16-mixed", bad=list(range(1, 99)), ranks=[0, 1], value=float("inf"), steps=12,
                            scale=dict(initial_scale=16.0, min_scale=1.0), diag=dict(max_min_scale_steps=3,
                                                                                     max_nonfinite_steps=100)),
}


class BadGPT(GPTLightningModule):
    def __init__(self, case, **kw) -> None:
        super().__init__(**kw)
        self.case = case

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx in self.case["bad"] and self.global_rank in self.case["ranks"]:
            loss = loss * self.case["value"]
        return loss

    def lr_scheduler_step(self, scheduler, metric) -> None:
        if self.case.get("hold") and self.trainer.strategy.precision_plugin.last_step_skipped:
            return  # the optimizer step was skipped: keep the schedule where it is
        super().lr_scheduler_step(scheduler, metric)


class Record(pl.Callback):
    def __init__(self) -> None:
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if k in ("loss_scale", "skipped_steps", "nonfinite_steps")}
        self.rows.append({"batch": batch_idx, "lr": trainer.optimizers[0].param_groups[0]["lr"],
                          "sched_count": getattr(sched, "last_epoch", None), **metrics,
                          "bar": sorted(k for k in trainer.progress_bar_metrics)})


def run(name: str, case: dict) -> dict:
    pl.seed_everything(0, verbose=False)
    cfg = gpt_tiny(n_layer=2, vocab_size=64, seq_len=16)
    model = BadGPT(case, model=cfg, lr=3e-3, warmup_steps=4, max_steps=case["steps"])
    strategy = DiagStrategy(stage=2, precision=case["precision"], bucket_mb=1,
                            diagnostics=DiagnosticsConfig(heartbeat_interval=0.5, **case.get("diag", {})))
    if "scale" in case:
        strategy.config = dataclasses.replace(strategy.config, loss_scale=LossScaleConfig(**case["scale"]))
    data = ByteCorpusDataModule(seq_len=cfg.seq_len, batch_size=4, source="random", vocab_size=64,
                                random_length=256, shuffle=False, max_bytes=2**20)
    rec = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=case["steps"], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[rec], limit_val_batches=0, num_sanity_val_steps=0)
    error = None
    try:
        trainer.fit(model, datamodule=data)
    except NumericsError as err:
        error = str(err)
    finite = all(math.isfinite(float(v.float().abs().sum())) for v in trainer.strategy.full_state_dict().values()
                 if v.is_floating_point())
    final = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"rows": rec.rows, "error": error, "finite": finite, "global_step": trainer.global_step, "final": final}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    results = {name: run(name, CASES[name]) for name in args.cases.split(",")}
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
