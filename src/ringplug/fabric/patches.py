"""Where ringplug changes Lightning Fabric's own behaviour under an MPI launcher: every change,
each guarded by `ringplug._patching.wrap` (a missing name is a warning and the fallback it
states, never an error in the middle of training).

Under ``ringrun -np N`` (or mpiexec, srun) with N > 1, once the script has imported ringplug:

- ``Fabric()`` left at the default ``strategy="auto"`` (scripts written for ``fabric run``,
  ``devices=1``) takes ``strategy="ring"``: the N processes are one job, not N copies.
- A Fabric with ring's strategy is set up when it is built, as ``fabric run`` sets up its
  processes, so a script without ``fabric.launch()`` runs; a script's own ``launch()`` then
  does nothing more, and a second ``launch()`` is refused.
- A Fabric left with a one-process strategy (``SingleDeviceStrategy``, ``"dp"``) stops at once,
  saying what to change: it would train N independent copies in silence.

Imported by `ringplug` right after ``lightning.fabric.fabric`` has run (it must not be imported
while Lightning's own modules are half-initialised), and mirrored for ``lightning_fabric``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.fabric as _package
from lightning.fabric.connector import _Connector
from lightning.fabric.fabric import Fabric
from lightning.fabric.strategies import DataParallelStrategy, SingleDeviceStrategy

from .._patching import wrap
from .common import launched_ranks, one_copy_per_rank_error
from .strategy import RingFabricStrategy

_VERSION = f"{_package.__name__} {getattr(_package, '__version__', '?')}"


def targets() -> list[tuple[Any, str]]:
    """Every (owner, attribute) of Lightning Fabric's that this module may replace or wrap."""
    return [(_Connector, "_choose_strategy"), (Fabric, "__init__"), (Fabric, "launch")]


def one_process(strategy: Any, world_size: int | None = None) -> bool:
    """Whether `strategy` trains in this process alone (a world of one)."""
    if isinstance(strategy, (SingleDeviceStrategy, DataParallelStrategy)):
        return True
    return world_size == 1


def _choose_strategy(original: Callable[..., Any]) -> Callable[..., Any]:
    def choose(self: Any) -> Any:
        choice = original(self)
        # Under an MPI launcher the ranks exist already: Lightning's choice (one device,
        # or DDP over devices it would count itself) gives way to the ring.
        if launched_ranks() > 1:
            return RingFabricStrategy.strategy_name
        return choice

    return choose


def _init(original: Callable[..., Any]) -> Callable[..., Any]:
    def init(self: Fabric, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        strategy = self.strategy
        ranks = launched_ranks()
        if ranks > 1 and one_process(strategy, self.world_size):
            raise one_copy_per_rank_error("Fabric", strategy, ranks)
        if isinstance(strategy, RingFabricStrategy) and ranks > 1 and not self._launched:
            # The launcher made the processes: set up now, as under `fabric run`, so that a
            # script written for it (no launch()) trains as one job.
            strategy.setup_environment()
            self._launched = True
            self._ringplug_set_up_by = "ringrun"

    return init


def _launch(original: Callable[..., Any]) -> Callable[..., Any]:
    def launch(self: Fabric, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.strategy, RingFabricStrategy):
            if getattr(self, "_ringplug_launch_called", False):
                raise RuntimeError(
                    "fabric.launch() was called a second time on this Fabric. The ranks run "
                    "and ringplug is set up already; call launch() once, right after "
                    "creating the Fabric (under ringrun it may be left out)."
                )
            self._ringplug_launch_called = True
        return original(self, *args, **kwargs)

    return launch


wrap(
    _Connector,
    "_choose_strategy",
    _choose_strategy,
    version=_VERSION,
    fallback="under ringrun, pass Fabric(strategy='ring'): the default strategy is left "
    "to Lightning, and a Fabric of one process is refused",
)
wrap(
    Fabric,
    "__init__",
    _init,
    version=_VERSION,
    fallback="a Fabric of one process under ringrun is not detected, and fabric.launch() is needed",
)
wrap(
    Fabric,
    "launch",
    _launch,
    version=_VERSION,
    fallback="a second fabric.launch() is not refused",
)
