"""The Lightning a worker trains with: ``TEST_LIGHTNING_PACKAGE=pytorch_lightning`` for the
standalone ``pytorch_lightning`` package (with ``ringplug.pytorch_lightning``), anything else
for ``lightning.pytorch`` (with ``ringplug.lightning``). The same scenarios run in both."""

from __future__ import annotations

import os
import sys

PACKAGE = os.environ.get("TEST_LIGHTNING_PACKAGE", "lightning")

if PACKAGE == "pytorch_lightning":
    import pytorch_lightning as L  # noqa: N812 - the name Lightning's docs use
    from pytorch_lightning.strategies import Strategy

    from ringplug.pytorch_lightning import RingStrategy
else:
    import lightning as L  # noqa: N812
    from lightning.pytorch.strategies import Strategy

    from ringplug.lightning import RingStrategy


def lightning_cli() -> type:
    """This Lightning's LightningCLI (imported on demand: it brings jsonargparse)."""
    if PACKAGE == "pytorch_lightning":
        from pytorch_lightning.cli import LightningCLI
    else:
        from lightning.pytorch.cli import LightningCLI
    return LightningCLI


def other_namespace_imported() -> bool:
    """Whether the other Lightning got imported too (a pytorch_lightning script must not
    pay for, or mix in, ``lightning``)."""
    return ("lightning" if PACKAGE == "pytorch_lightning" else "pytorch_lightning") in sys.modules


__all__ = ["PACKAGE", "L", "RingStrategy", "Strategy", "lightning_cli", "other_namespace_imported"]
