"""Optimizers that work in a plain torch.distributed script and under the strategies."""

from lightning_scale.optim.onebit_adam import OneBitAdam, OneBitAdamShard, check_zero_stage

__all__ = ["OneBitAdam", "OneBitAdamShard", "check_zero_stage"]
