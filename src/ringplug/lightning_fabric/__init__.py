"""ringplug for the standalone ``lightning_fabric`` package: ``Fabric(strategy="ring")``.

The same `RingFabricStrategy` and `RingEnvironment` as `ringplug.fabric`, built on
``lightning_fabric``'s classes (its Fabric refuses strategies built on ``lightning.fabric``)::

    from lightning_fabric import Fabric
    from ringplug.lightning_fabric import RingFabricStrategy

    fabric = Fabric(strategy=RingFabricStrategy(compression="fp16"), accelerator="cpu")

The modules of this package are `ringplug.fabric`'s own files, executed with their imports
of ``lightning.fabric`` renamed to ``lightning_fabric`` (see `ringplug._mirror`).
``import ringplug.lightning_fabric`` imports ``lightning_fabric`` and registers "ring".
"""

from .._mirror import STANDALONE, mirror

mirror(globals(), "ringplug.fabric", STANDALONE)
