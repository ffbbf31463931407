"""Lightning glue: the only layer that imports Lightning. Importing it registers the presets
(``lightning_scale.config.PRESETS``) with the Trainer's StrategyRegistry and Fabric's STRATEGY_REGISTRY."""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_scale.strategies.fabric import Zero3DFabricStrategy, ZeroFabricPrecision
from lightning_scale.strategies.precision import ZeroPrecision
from lightning_scale.strategies.zero3d import Zero3DStrategy

Zero3DStrategy.register_strategies(StrategyRegistry)
Zero3DFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = ["Zero3DFabricStrategy", "Zero3DStrategy", "ZeroFabricPrecision", "ZeroPrecision"]
