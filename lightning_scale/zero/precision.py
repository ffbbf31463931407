"""Precision policies and loss scaling, handed to the ZeRO engine (no precision branches in step()).

A policy says in which dtype parameters and gradients live for compute and communication, and in
which dtype the master weights and the optimizer state inside the shards live:

============  ===============  ============  ========  ============
precision     params / grads   master        autocast  loss scaling
============  ===============  ============  ========  ============
32-true       fp32             (the params)  -         -
64-true       fp64             (the params)  -         -
bf16-mixed    bf16             fp32          bf16      -
16-mixed      fp16             fp32          fp16      dynamic
bf16-true     bf16             (the params)  -         -
16-true       fp16             (the params)  -         -
============  ===============  ============  ========  ============
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from lightning_scale.config import ConfigError, LossScaleConfig, PRECISIONS


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str = "32-true"
    param_dtype: Optional[torch.dtype] = None  # None: keep the model's dtype
    master_dtype: Optional[torch.dtype] = None  # None: the sharded params are the master weights
    autocast_dtype: Optional[torch.dtype] = None
    loss_scaling: bool = False

    def master_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.master_dtype if self.master_dtype is not None else param_dtype


def policy_for(precision: str) -> PrecisionPolicy:
    table = {
        "32-true": PrecisionPolicy("32-true", torch.float32),
        "64-true": PrecisionPolicy("64-true", torch.float64),
        "bf16-mixed": PrecisionPolicy("bf16-mixed", torch.bfloat16, torch.float32, torch.bfloat16),
        "16-mixed": PrecisionPolicy("16-mixed", torch.float16, torch.float32, torch.float16, loss_scaling=True),
        "bf16-true": PrecisionPolicy("bf16-true", torch.bfloat16),
        "16-true": PrecisionPolicy("16-true", torch.float16),
    }
    key = {"32": "32-true", "64": "64-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(str(precision), str(precision))
    if key not in table:
        raise ConfigError(f"precision={precision!r}: Zero3DStrategy supports {', '.join(PRECISIONS)}")
    return table[key]


class NumericsError(RuntimeError):
    """Non-finite losses / gradients, or an fp16 loss scale pinned at its minimum, for too many steps in a row.
    Raised on every rank at the same step (the decision is all-reduced), so it is not a "first error"."""

    raised_on_every_rank = True


class NoLossScaler:
    scale = 1.0
    skipped_steps = 0
    steps_at_min = 0

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


class DynamicLossScaler:
    """fp16 dynamic loss scaling: back off on overflow, grow after ``growth_interval`` clean steps.

    The overflow decision must be the same on every rank; the engine all-reduces it before calling
    ``update``. ``hysteresis`` overflows in a row are needed before the scale backs off.
    """

    def __init__(self, cfg: Optional[LossScaleConfig] = None) -> None:
        self.cfg = (cfg or LossScaleConfig()).validate()
        self.scale = float(self.cfg.initial_scale)
        self._good_steps = 0
        self._hysteresis_left = self.cfg.hysteresis
        self.skipped_steps = 0
        self.steps_at_min = 0  # overflowing steps in a row with the scale already at min_scale (fp16 cannot cope)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.skipped_steps += 1
            self.steps_at_min = self.steps_at_min + 1 if self.scale <= self.cfg.min_scale else 0
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.cfg.min_scale, self.scale * self.cfg.backoff_factor)
                self._hysteresis_left = self.cfg.hysteresis
            return
        self._good_steps += 1
        self.steps_at_min = 0
        self._hysteresis_left = self.cfg.hysteresis
        if self._good_steps % self.cfg.growth_interval == 0:
            self.scale *= self.cfg.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def make_loss_scaler(policy: PrecisionPolicy, cfg: Optional[LossScaleConfig] = None):
    return DynamicLossScaler(cfg) if policy.loss_scaling else NoLossScaler()
