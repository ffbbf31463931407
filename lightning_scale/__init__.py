"""lightning_scale: DeepSpeed's large-model training technologies for PyTorch Lightning, in pure PyTorch + Triton.

``import lightning_scale`` registers the strategies ("zero3d", "zero1", "zero2", ...) with Lightning's
StrategyRegistry, so ``Trainer(strategy="zero2")`` works, whichever of the two is imported first.

Importing the package itself is cheap (no torch, Lightning or triton): the command-line tools
(``python -m lightning_scale.estimate``, ``python -m lightning_scale.zero.state_dict``) start in well under
a second of imports. Registration happens as soon as Lightning is in the process: at once when
``lightning.pytorch`` is already imported, else right after its import finishes (a one-shot import hook).
``lightning_scale.Zero3DStrategy`` / ``ZeroPrecision`` / ``Topology`` are loaded on first access.
"""

from __future__ import annotations

import importlib
import os as _os

from lightning_scale._import_hook import run_after_import
from lightning_scale.config import (
    ConfigError,
    LossScaleConfig,
    OffloadConfig,
    ParallelConfig,
    PipelineConfig,
    TensorParallelConfig,
    ZeroConfig,
)

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access (PEP 562)
_LAZY = {"Topology": "lightning_scale.topology", "Zero3DStrategy": "lightning_scale.strategies",
         "ZeroPrecision": "lightning_scale.strategies", "from_pretrained": "lightning_scale.pretrained",
         "load_pretrained": "lightning_scale.pretrained"}

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
    "Zero3DStrategy",
    "ZeroPrecision",
    "from_pretrained",
    "load_pretrained",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later accesses skip this hook
        return value
    raise AttributeError(f"module 'lightning_scale' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _register_strategies(_module=None) -> None:
    importlib.import_module("lightning_scale.strategies")  # its import registers (idempotent)


# Worker processes of the pure-torch tests set this to skip Lightning altogether.
if not _os.environ.get("LIGHTNING_SCALE_SKIP_REGISTER"):
    # Lightning has no entry point for strategies, and importing it here would cost every CLI ~5 s.
    run_after_import("lightning.pytorch", _register_strategies)
