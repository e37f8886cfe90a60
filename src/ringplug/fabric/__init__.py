"""ringplug for Lightning Fabric: ``Fabric(strategy="ring")`` or ``strategy=RingFabricStrategy()``.

``import ringplug.fabric`` imports ``lightning.fabric`` and registers the name "ring" (so does
``import ringplug``, once the script imports Lightning). For the standalone
``lightning_fabric`` package, the same strategy is `ringplug.lightning_fabric`.

Example:
    >>> import ringplug  # doctest: +SKIP
    >>> from lightning.fabric import Fabric
    >>> fabric = Fabric(strategy="ring", accelerator="cpu", devices=2)  # or under ringrun
    >>> fabric.launch()
    >>> model, optimizer = fabric.setup(model, optimizer)
    >>> loader = fabric.setup_dataloaders(loader)    # each rank gets its shard
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from .environment import RingEnvironment
from .strategy import RingFabricStrategy

RingFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["RingEnvironment", "RingFabricStrategy"]
