from lightning_scale.zero.flat_buffer import Bucket, build_buckets
from lightning_scale.zero.optimizer import ZeroOptimizer
from lightning_scale.zero.precision import DynamicLossScaler, NoLossScaler, PrecisionPolicy, policy_for

__all__ = [
    "Bucket",
    "DynamicLossScaler",
    "NoLossScaler",
    "PrecisionPolicy",
    "ZeroOptimizer",
    "build_buckets",
    "policy_for",
]
