"""ZeRO engines (stages 0-3, offload, 1-bit) and their checkpoint tools.

The names below load on first access (PEP 562), so ``python -m lightning_scale.zero.state_dict --help`` and
its error for a missing folder answer before torch is imported.
"""

_LAZY = {
    "Bucket": "flat_buffer", "build_buckets": "flat_buffer", "ZeroOptimizer": "optimizer",
    "DynamicLossScaler": "precision", "NoLossScaler": "precision", "PrecisionPolicy": "precision",
    "policy_for": "precision",
}

__all__ = [
    "Bucket",
    "DynamicLossScaler",
    "NoLossScaler",
    "PrecisionPolicy",
    "ZeroOptimizer",
    "build_buckets",
    "policy_for",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"lightning_scale.zero.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_scale.zero' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
