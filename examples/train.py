"""The main job: train a byte-level GPT on the Python standard library's sources with lightning_scale.

    python examples/train.py                                  # ZeRO-2, 2 CPU processes (or all GPUs), ~2 min
    python examples/train.py strategy=zero1 trainer.devices=4
    python examples/train.py precision=fp16 model=gpt_smoke trainer=smoke   # real fp16 (the strategy's own plugin)
    python examples/train.py logger=tensorboard                # or logger=wandb (offline), default logger=csv
    python examples/train.py -m strategy=zero1,zero2 trainer=smoke   # Hydra multirun

Shows Lightning's progress bar, logs train/val loss, tokens/s, memory per rank (and the fp16 loss scale) with
the chosen logger, saves a checkpoint, writes plots (``python -m lightning_scale.plot RUN_DIR``, needs
matplotlib) and prints the final validation loss, tokens/s and where everything is.
"""

from __future__ import annotations

import os
import sys
import time

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale.config import PRESETS, ConfigError
from lightning_scale.config import HYDRA, speaking
from lightning_scale.hydra_config import check_before_training, register_configs, resolve_devices
from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule
from lightning_scale.lit.callbacks import TokenThroughput
from lightning_scale.models.gpt import GPTConfig

register_configs()


class RunMetrics(pl.Callback):
    """Logs what the plots show besides the losses: tokens/s of each logged step, every rank's resident
    memory (gathered, so rank 0's logger has all of them) and, under fp16, the dynamic loss scale."""

    def __init__(self, every: int) -> None:
        self.every = max(int(every), 1)
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.global_step % self.every) or not trainer.global_step:
            return
        import psutil

        dp = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1)
        metrics = {"perf/tokens_per_sec": batch[0].numel() * dp / max(time.perf_counter() - self._t0, 1e-9)}
        rss = torch.tensor([psutil.Process().memory_info().rss / 2**20], dtype=torch.float64)
        every_rank = trainer.strategy.all_gather(rss).reshape(-1)  # (world,) MiB, one per rank
        metrics.update({f"memory/rank{r}_MiB": float(v) for r, v in enumerate(every_rank)})
        scaler = getattr(trainer.strategy.precision_plugin, "loss_scaler", None)
        if getattr(getattr(trainer.strategy.precision_plugin, "policy", None), "loss_scaling", False):
            metrics["perf/loss_scale"] = float(scaler.scale)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)


class LastValidation(pl.Callback):
    """The step of the last validation during fit: the final val_loss is re-measured only when fit did not
    end on one (a second run at the same step logged a duplicate row)."""

    step = -1

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.step = trainer.global_step


def _strategy(cfg: DictConfig):
    """The lightning_scale strategies carry the precision in their own plugin, so `precision=fp16` really is
    fp16 (Lightning's flag alone turns 16-mixed into bf16-mixed on CPU); the startup table prints it."""
    if str(cfg.strategy.name).lower() in PRESETS and cfg.strategy.get("precision") is None:
        cfg.strategy.precision = cfg.precision
    return check_before_training(cfg)  # ConfigError naming the Hydra key, before any process starts


def _plot(out_dir: str) -> str:
    try:
        from lightning_scale.plot import plot_run

        return "plots " + ", ".join(sorted(plot_run(out_dir))) or "(nothing to plot)"
    except ImportError:
        return f"plots: pip install matplotlib, then python -m lightning_scale.plot {out_dir}"


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        return _train(cfg)
    except ConfigError as err:  # the user's own words, not Hydra's "Error executing job" and a traceback
        print(f"ConfigError: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def _train(cfg: DictConfig) -> float:
    strategy = _strategy(cfg)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = HydraConfig.get().runtime.output_dir
    model_cfg = GPTConfig(**OmegaConf.to_container(cfg.model))
    attention = hydra.utils.instantiate(cfg.attention) if cfg.attention is not None else None
    opt = cfg.optimizer
    module = GPTLightningModule(model=model_cfg, lr=opt.lr, weight_decay=opt.weight_decay, betas=tuple(opt.betas),
                                warmup_steps=opt.warmup_steps, max_steps=cfg.trainer.max_steps,
                                min_lr_ratio=opt.min_lr_ratio, attention=attention, optimizer=opt.name,
                                freeze_step=opt.freeze_step)
    data = ByteCorpusDataModule(seq_len=model_cfg.seq_len, batch_size=cfg.data.batch_size,
                                max_bytes=cfg.data.max_bytes, val_fraction=cfg.data.val_fraction,
                                num_workers=cfg.data.num_workers, source=cfg.data.source,
                                vocab_size=model_cfg.vocab_size)
    t = cfg.trainer
    accelerator, devices = resolve_devices(t.accelerator, t.devices)
    throughput, last_val = TokenThroughput(), LastValidation()
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(out_dir, "checkpoints"), save_last=True,
                                              monitor="val_loss", save_top_k=1)
    logger = hydra.utils.instantiate(cfg.logger) if cfg.get("logger") is not None else False
    with speaking(HYDRA):  # a ConfigError raised at setup or in a step names the Hydra key (strategy.*)
        trainer = pl.Trainer(
            accelerator=accelerator, devices=devices, num_nodes=t.num_nodes, strategy=strategy,
            precision=cfg.precision, max_steps=t.max_steps, max_time=t.max_time, val_check_interval=t.val_check_interval,
            check_val_every_n_epoch=None, limit_val_batches=t.limit_val_batches,
            accumulate_grad_batches=t.accumulate_grad_batches, gradient_clip_val=t.gradient_clip_val,
            log_every_n_steps=t.log_every_n_steps, enable_progress_bar=t.enable_progress_bar,
            default_root_dir=out_dir, logger=logger,
            # TQDM: Lightning's rich bar prints "Epoch 0/-2" for a run bounded by max_steps (max_epochs=-1)
            callbacks=[throughput, checkpoint, last_val, RunMetrics(t.log_every_n_steps)]
            + ([pl.callbacks.TQDMProgressBar()] if t.enable_progress_bar else [])
            + ([pl.callbacks.LearningRateMonitor()] if logger else []),
        )
        trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
        if last_val.step == trainer.global_step and "val_loss" in trainer.callback_metrics:
            val_loss = float(trainer.callback_metrics["val_loss"])
        else:  # fit stopped between validations (max_time, or max_steps off the val interval)
            val_loss = trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
    if trainer.is_global_zero:
        if logger:
            logger.finalize("success")  # flush the files the plots read
        logs = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None) or "(no logger)"
        print(f"final val_loss {val_loss:.4f} | train tokens/s {throughput.tokens_per_sec:,.0f} | "
              f"steps {trainer.global_step} | checkpoint {checkpoint.last_model_path or checkpoint.best_model_path} | "
              f"logs {logs}", flush=True)
        print(_plot(out_dir), flush=True)
    return float(val_loss)


if __name__ == "__main__":
    main()
