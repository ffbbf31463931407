"""Optimizers that work in a plain torch.distributed script and under the strategies."""

from lightning_scale.optim.cpu_adam import make_offload_optimizer, offload_step_impl
from lightning_scale.optim.onebit_adam import OneBitAdam, OneBitAdamShard, check_zero_stage

__all__ = ["OneBitAdam", "OneBitAdamShard", "check_zero_stage", "make_offload_optimizer", "offload_step_impl"]
