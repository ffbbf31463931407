"""The main job: train a byte-level GPT on the Python standard library's sources with lightning_scale.

    python examples/train.py                                  # ZeRO-2, 2 CPU processes (or all GPUs), ~2 min
    python examples/train.py strategy=zero1 trainer.devices=4
    python examples/train.py precision=bf16 model=gpt_tiny trainer=smoke
    python examples/train.py -m strategy=zero1,zero2 trainer=smoke   # Hydra multirun

Shows Lightning's progress bar, logs train/val loss with the CSV logger, saves a checkpoint, and prints
the final validation loss and tokens/s.
"""

from __future__ import annotations

import os

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale.hydra_config import build_strategy, register_configs, resolve_devices
from lightning_scale.lit import ByteCorpusDataModule, GPTLightningModule
from lightning_scale.lit.callbacks import TokenThroughput
from lightning_scale.models.gpt import GPTConfig

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
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
    throughput = TokenThroughput()
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(out_dir, "checkpoints"), save_last=True,
                                              monitor="val_loss", save_top_k=1)
    trainer = pl.Trainer(
        accelerator=accelerator, devices=devices, num_nodes=t.num_nodes, strategy=build_strategy(cfg.strategy),
        precision=cfg.precision, max_steps=t.max_steps, max_time=t.max_time, val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None, limit_val_batches=t.limit_val_batches,
        accumulate_grad_batches=t.accumulate_grad_batches, gradient_clip_val=t.gradient_clip_val,
        log_every_n_steps=t.log_every_n_steps, enable_progress_bar=t.enable_progress_bar,
        default_root_dir=out_dir, logger=pl.loggers.CSVLogger(out_dir, name="logs"),
        callbacks=[throughput, checkpoint, pl.callbacks.LearningRateMonitor()],
    )
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    val_loss = trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
    if trainer.is_global_zero:
        print(f"final val_loss {val_loss:.4f} | train tokens/s {throughput.tokens_per_sec:,.0f} | "
              f"steps {trainer.global_step} | checkpoint {checkpoint.last_model_path or checkpoint.best_model_path} | "
              f"logs {trainer.logger.log_dir}", flush=True)
    return float(val_loss)


if __name__ == "__main__":
    main()
