"""ringplug for PyTorch Lightning: `Trainer(strategy=RingStrategy())` or `strategy="ring"`.

``import ringplug.lightning`` imports Lightning and registers the name "ring". For the
standalone ``pytorch_lightning`` package the same strategy is `ringplug.pytorch_lightning`
(these files, mirrored: see `ringplug._mirror`), and for Lightning Fabric `ringplug.fabric`.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .environment import RingEnvironment
from .strategy import RingStrategy, RingSyncBatchNorm

RingStrategy.register_strategies(StrategyRegistry)

__all__ = ["RingEnvironment", "RingStrategy", "RingSyncBatchNorm"]
