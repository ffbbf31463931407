"""Numerics that announce themselves (issue 15): non-finite losses / gradient norms skip the step on every rank,
and runs that cannot recover stop with an error naming the step.

Per optimizer step, when enabled: every rank checks its loss and (without fp16 loss scaling, whose overflow check
already covers gradients) the squared norm of its reduced gradient shard; one all-reduce (MAX of 2 floats) over
the world makes the decision common, so all ranks skip the same step (``engine.mark_overflow()``: the step is
dropped, gradients cleared, an fp16 loss scale backs off). ``on_nonfinite="raise"`` raises at once instead.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_scale.comm import collectives as C
from lightning_scale.zero.precision import NumericsError

PREFIX = "[lightning_scale]"


def _step(model: Any) -> int:
    try:
        return int(model.trainer.global_step)
    except Exception:  # noqa: BLE001 - no trainer attached (plain engine use)
        return -1


def _device(engine: Any) -> torch.device:
    masters = getattr(engine, "masters", None)
    return masters[0].device if masters else torch.device("cpu")


class NumericsGuard:
    def __init__(self, on_nonfinite: Optional[str], max_nonfinite_steps: int = 10, max_min_scale_steps: int = 20,
                 *, loss_scaling: bool = False) -> None:
        self.on_nonfinite = on_nonfinite  # None: off (no check, no collective)
        self.max_nonfinite_steps, self.max_min_scale_steps = max_nonfinite_steps, max_min_scale_steps
        self.loss_scaling = loss_scaling
        self.nonfinite_steps = 0  # steps skipped for a non-finite loss / gradient norm
        self.streak = 0  # skipped steps in a row (any reason)

    def check(self, loss: Any, engine: Any, model: Any) -> bool:
        """After gradient reduction, before the step: True when every rank skips this step."""
        if self.on_nonfinite in (None, "ignore"):
            return False
        flags = torch.zeros(2, dtype=torch.float32, device=_device(engine))  # (loss, grad norm) non-finite
        if isinstance(loss, torch.Tensor) and loss.numel() and not bool(torch.isfinite(loss.detach()).all()):
            flags[0] = 1.0
        if not self.loss_scaling and hasattr(engine, "local_grad_sq_norm"):
            if not bool(torch.isfinite(engine.local_grad_sq_norm())):
                flags[1] = 1.0
        C.all_reduce(flags, None, op=torch.distributed.ReduceOp.MAX, tag="nonfinite")
        if not bool(flags.any()):
            return False
        what = " and ".join(n for n, f in zip(("loss", "gradient norm"), flags.tolist()) if f)
        step = _step(model)
        if self.on_nonfinite == "raise":
            raise NumericsError(f"non-finite {what} at global step {step} (diagnostics.on_nonfinite='raise')")
        engine.mark_overflow()
        self.nonfinite_steps += 1
        if getattr(getattr(model, "trainer", None), "is_global_zero", True):
            print(f"{PREFIX} global step {step}: non-finite {what} on some rank: step skipped on every rank "
                  f"({self.nonfinite_steps} skipped so far)", flush=True)
        return True

    def after_step(self, skipped: bool, scaler: Any, model: Any) -> None:
        """Counts skipped steps in a row; raises :class:`NumericsError` past the configured limits."""
        if self.on_nonfinite is None:
            return
        self.streak = self.streak + 1 if skipped else 0
        step = _step(model)
        if self.loss_scaling and getattr(scaler, "steps_at_min", 0) >= self.max_min_scale_steps:
            raise NumericsError(
                f"fp16 loss scale pinned at its minimum ({scaler.scale:g}) for {scaler.steps_at_min} overflowing "
                f"steps in a row, the last at global step {step}: the values overflow float16 even unscaled. "
                "Train in bf16 (precision='bf16-mixed'), or lower the learning rate "
                "(diagnostics.max_min_scale_steps sets the limit)")
        if self.streak >= self.max_nonfinite_steps:
            raise NumericsError(
                f"{self.streak} optimizer steps in a row were skipped (non-finite loss / gradients or fp16 overflow), "
                f"the last at global step {step}: the run cannot recover "
                "(diagnostics.max_nonfinite_steps sets the limit)")
