"""ringplug for the standalone ``pytorch_lightning`` package: ``pl.Trainer(strategy="ring")``.

The same `RingStrategy`, `RingEnvironment` and `RingSyncBatchNorm` as `ringplug.lightning`,
built on ``pytorch_lightning``'s classes (its Trainer refuses strategies built on
``lightning.pytorch``). ``import ringplug`` before the Trainer is made registers
``strategy="ring"`` with whichever Lightning the script imports; the class is for arguments::

    import pytorch_lightning as pl
    from ringplug.pytorch_lightning import RingStrategy

    trainer = pl.Trainer(strategy=RingStrategy(compression="fp16"), accelerator="cpu")

and for LightningCLI (``pytorch_lightning.cli``): ``class_path:
ringplug.pytorch_lightning.RingStrategy``.

The modules of this package are `ringplug.lightning`'s own files, executed with their
imports of ``lightning.pytorch`` / ``lightning.fabric`` renamed to ``pytorch_lightning`` /
``lightning_fabric`` (see `ringplug._mirror`): one implementation, two registrations.
``import ringplug.pytorch_lightning`` imports ``pytorch_lightning`` and registers "ring".
"""

from .._mirror import STANDALONE, mirror

mirror(globals(), "ringplug.lightning", STANDALONE)
