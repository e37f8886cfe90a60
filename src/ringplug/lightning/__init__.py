"""ringplug for PyTorch Lightning: `Trainer(strategy=RingStrategy())` or `strategy="ring"`.

``import ringplug.lightning`` imports Lightning and registers the name "ring".
"""

from lightning.pytorch.strategies import StrategyRegistry

from .environment import RingEnvironment
from .strategy import RingStrategy, RingSyncBatchNorm, allow_compiled_models

RingStrategy.register_strategies(StrategyRegistry)
allow_compiled_models()  # trainer.fit(torch.compile(model)) under RingStrategy, as under DDP

__all__ = ["RingEnvironment", "RingStrategy", "RingSyncBatchNorm"]
