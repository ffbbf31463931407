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
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clip_gradients below
        engine.step()  # skipped (and the loss scale backed off) when any rank overflowed
        return closure_result

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
