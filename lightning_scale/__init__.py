"""lightning_scale: DeepSpeed's large-model training technologies for PyTorch Lightning, in pure PyTorch + Triton.

``import lightning_scale`` registers the strategies ("zero3d", "zero1", "zero2", ...) with Lightning's
StrategyRegistry, so ``Trainer(strategy="zero2")`` works.
"""

import os as _os

from lightning_scale.config import (
    ConfigError,
    LossScaleConfig,
    OffloadConfig,
    ParallelConfig,
    PipelineConfig,
    TensorParallelConfig,
    ZeroConfig,
)
from lightning_scale.topology import Topology

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "LossScaleConfig",
    "OffloadConfig",
    "ParallelConfig",
    "PipelineConfig",
    "TensorParallelConfig",
    "Topology",
    "ZeroConfig",
    "__version__",
]

# Worker processes of the pure-torch tests set this to skip importing Lightning (3 s per process).
if not _os.environ.get("LIGHTNING_SCALE_SKIP_REGISTER"):
    try:
        from lightning_scale.strategies import Zero3DStrategy, ZeroPrecision  # noqa: F401  (registers)

        __all__ += ["Zero3DStrategy", "ZeroPrecision"]
    except ModuleNotFoundError as _err:  # pragma: no cover - lightning not installed: pure-torch use only
        if not (_err.name or "").startswith("lightning"):
            raise
