"""Where ringplug changes the Trainer's own choice of strategy under an MPI launcher, guarded by
`ringplug._patching.wrap` (a missing name is a warning and the fallback it states).

Under ``ringrun -np N`` (or mpiexec, srun) with N > 1, once the script has imported ringplug,
the same rule as Fabric's (`ringplug.fabric.patches`):

- a ``Trainer()`` whose strategy Lightning would resolve to one device of its own (the default
  ``strategy="auto"`` on one device, ``devices=1``) takes ``strategy="ring"``: the N ranks
  train as one job;
- a Trainer left with a one-process strategy (``SingleDeviceStrategy``) stops at once, saying
  what to change, instead of training N copies in silence.

Imported by `ringplug` right after ``lightning.pytorch.trainer.trainer`` has run, and mirrored
for ``pytorch_lightning``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as _package
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.trainer.trainer import Trainer

from .._patching import wrap
from ..fabric.common import launched_ranks, one_copy_per_rank_error
from .strategy import RingStrategy

_VERSION = f"{_package.__name__} {getattr(_package, '__version__', '?')}"


def _choose_strategy(original: Callable[..., Any]) -> Callable[..., Any]:
    def choose(self: Any) -> Any:
        choice = original(self)
        if isinstance(choice, SingleDeviceStrategy) and launched_ranks() > 1:
            return RingStrategy.strategy_name
        return choice

    return choose


def _init(original: Callable[..., Any]) -> Callable[..., Any]:
    def init(self: Trainer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        ranks = launched_ranks()
        if ranks > 1 and (isinstance(self.strategy, SingleDeviceStrategy) or self.world_size == 1):
            raise one_copy_per_rank_error("Trainer", self.strategy, ranks)

    return init


wrap(
    _AcceleratorConnector,
    "_choose_strategy",
    _choose_strategy,
    version=_VERSION,
    fallback="under ringrun, pass Trainer(strategy='ring'): the default strategy is left "
    "to Lightning, and a Trainer of one process is refused",
)
wrap(
    Trainer,
    "__init__",
    _init,
    version=_VERSION,
    fallback="a Trainer of one process under ringrun is not detected",
)
