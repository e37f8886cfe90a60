"""ringplug for PyTorch Lightning: `Trainer(strategy=RingStrategy())` or `strategy="ring"`.

``import ringplug.lightning`` imports Lightning and registers the name "ring".
"""

from lightning.pytorch.strategies import StrategyRegistry

from .environment import RingEnvironment
from .strategy import RingStrategy, RingSyncBatchNorm

RingStrategy.register_strategies(StrategyRegistry)

__all__ = ["RingEnvironment", "RingStrategy", "RingSyncBatchNorm"]
