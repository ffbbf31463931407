"""ZeroPrecision: the Lightning Precision plugin that Zero3DStrategy selects from ``precision=``.

Unlike Lightning's autocast-only ``MixedPrecision`` (fp32 parameters, fp32 gradients), the model's
parameters and gradients are cast to the low-precision dtype for compute and communication, while the
ZeRO engine keeps fp32 master weights and optimizer state inside the shards (see
``lightning_scale.zero.precision``). fp16 uses dynamic loss scaling; an overflow on any rank skips the
step on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Generator, Optional

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from lightning_scale.config import LossScaleConfig
from lightning_scale.zero.numerics import NumericsGuard
from lightning_scale.zero.precision import PrecisionPolicy, make_loss_scaler, policy_for


class ZeroPrecision(Precision):
    def __init__(self, precision: str = "32-true", loss_scale: Optional[LossScaleConfig] = None) -> None:
        super().__init__()
        self.policy: PrecisionPolicy = policy_for(precision)
        self.precision = self.policy.name  # type: ignore[assignment]
        self.loss_scale_config = loss_scale or LossScaleConfig()
        self.loss_scaler = make_loss_scaler(self.policy, self.loss_scale_config)
        self.device_type = "cpu"
        self._engines: Dict[int, Any] = {}
        self._numerics = NumericsGuard(None)  # off until configure_numerics (diagnostics_glue.install)
        self.last_step_skipped = False  # the lr-scheduler recipe of docs/failures.md reads it

    # ------------------------------------------------------------------ wiring
    def register_engine(self, optimizer: torch.optim.Optimizer, engine: Any) -> None:
        self._engines[id(optimizer)] = engine

    def engine_for(self, optimizer: Any) -> Optional[Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        return self._engines.get(id(optimizer))

    # ------------------------------------------------------------------ module / forward
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.policy.param_dtype is not None:
            module = module.to(self.policy.param_dtype)
        return module

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.policy.autocast_dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.policy.autocast_dtype):
            yield

    def convert_input(self, data: Any) -> Any:
        return data

    # ------------------------------------------------------------------ backward / step
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if self.policy.loss_scaling:
            tensor = tensor * self.loss_scaler.scale
        model.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        engine = self.engine_for(optimizer)
        if engine is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()  # forward + backward; most buckets are reduced during backward
        engine.reduce_gradients()  # the rest, then unscale and the all-rank overflow decision
        nonfinite = self._numerics.check(closure_result, engine, model)  # all ranks agree; may mark_overflow()
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clip_gradients below
        skipped_before = self.loss_scaler.skipped_steps
        engine.step()  # skipped (and the loss scale backed off) when any rank overflowed
        self.last_step_skipped = nonfinite or self.loss_scaler.skipped_steps > skipped_before
        self._numerics.after_step(self.last_step_skipped, self.loss_scaler, model)
        return closure_result

    # ------------------------------------------------------------------ numerics (issue 15)
    def configure_numerics(self, on_nonfinite: Optional[str] = "skip", max_nonfinite_steps: int = 10,
                           max_min_scale_steps: int = 20) -> None:
        """Non-finite loss / gradient norm handling ("skip" | "raise" | "ignore"; None: no check, no collective)
        and the stop after K skipped steps in a row / K steps at the fp16 minimum scale."""
        self._numerics = NumericsGuard(on_nonfinite, max_nonfinite_steps, max_min_scale_steps,
                                       loss_scaling=self.policy.loss_scaling)

    def numerics_stats(self) -> Dict[str, float]:
        """What the diagnostics callback logs every step: loss_scale / skipped_steps (fp16), nonfinite_steps."""
        out: Dict[str, float] = {}
        if self.policy.loss_scaling:
            out.update(loss_scale=float(self.loss_scaler.scale), skipped_steps=float(self.loss_scaler.skipped_steps))
        if self._numerics.on_nonfinite not in (None, "ignore"):
            out["nonfinite_steps"] = float(self._numerics.nonfinite_steps)
        return out

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val is None or clip_val <= 0:
            return
        engine = self.engine_for(optimizer)
        if engine is None:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            engine.clip_grad_value_(float(clip_val))
        else:
            engine.clip_grad_norm_(float(clip_val))

    # ------------------------------------------------------------------ state (the scaler lives in the engines' state)
    def state_dict(self) -> Dict[str, Any]:
        return {"precision": self.precision, **self.loss_scaler.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if state_dict.get("scale") is not None:
            self.loss_scaler.load_state_dict(state_dict)
