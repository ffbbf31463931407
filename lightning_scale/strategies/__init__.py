"""Lightning glue: the only layer that imports Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_scale.strategies.precision import ZeroPrecision
from lightning_scale.strategies.zero3d import Zero3DStrategy

Zero3DStrategy.register_strategies(StrategyRegistry)

__all__ = ["Zero3DStrategy", "ZeroPrecision"]
