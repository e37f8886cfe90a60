"""ringplug: data-parallel training for Lightning and Keras over ring-allreduce.

``import ringplug`` is cheap: it loads no ML framework, not even numpy, and does not start
MPI. The core's names (`ringplug.init`, `ringplug.allreduce`, ...) load on first use
(PEP 562), and `ringplug.init()` is what starts MPI.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from . import _public

__version__ = "0.1.0"

_CORE_NAMES = frozenset(_public.__all__)  # loaded from ringplug.core on first use
__all__ = ["__version__", *_public.__all__]

if TYPE_CHECKING:
    from .core import *  # noqa: F403


class _RegisterStrategies(importlib.abc.MetaPathFinder):
    """Registers strategy="ring" with each Lightning namespace once its strategies module has
    been imported: `Trainer(strategy="ring")` in `lightning.pytorch` and `pytorch_lightning`,
    `Fabric(strategy="ring")` in `lightning.fabric` and `lightning_fabric`; and, once the
    modules of `Fabric` and `Trainer` have run, ringplug's guarded changes to them.

    Lightning has no entry point for strategies (its registries are filled from its own
    modules), and `import ringplug` must not import Lightning: so the name is registered
    when the user's own code imports Lightning, by importing ringplug's integration for
    that namespace right after Lightning's strategies module has run.
    """

    def __init__(self, pending: dict[str, str]) -> None:
        self.pending = pending  # Lightning's strategies module -> ringplug's integration

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        integration = self.pending.pop(fullname, None)
        if integration is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # this finder no longer answers for it
        if spec is None or not callable(getattr(spec.loader, "exec_module", None)):
            # A loader without exec_module (none of Python's own): Lightning loads as it
            # is, and "ring" needs `import ringplug.lightning` (or .fabric) by hand.
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            # A Lightning too old for ringplug: leave the user's import untouched.
            with contextlib.suppress(ImportError):
                importlib.import_module(integration, __name__)  # registers "ring"

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_INTEGRATIONS = {
    "lightning.fabric.strategies": ".fabric",
    "lightning.pytorch.strategies": ".lightning",
    "lightning_fabric.strategies": ".lightning_fabric",
    "pytorch_lightning.strategies": ".pytorch_lightning",
    # Under an MPI launcher, a Fabric or Trainer of one process joins the ring or stops
    # (ringplug.fabric.patches): once the module that defines the class has run.
    "lightning.fabric.fabric": ".fabric.patches",
    "lightning.pytorch.trainer.trainer": ".lightning.patches",
    "lightning_fabric.fabric": ".lightning_fabric.patches",
    "pytorch_lightning.trainer.trainer": ".pytorch_lightning.patches",
}


def _register_strategy_names() -> None:
    pending = {}
    for strategies, integration in _INTEGRATIONS.items():
        if strategies in sys.modules:
            importlib.import_module(integration, __name__)
        else:
            pending[strategies] = integration
    if pending and not any(isinstance(f, _RegisterStrategies) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterStrategies(pending))


_register_strategy_names()


def __getattr__(name: str) -> Any:
    if name in _CORE_NAMES:
        value = getattr(importlib.import_module(".core", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in ("core", "run", "bench"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ringplug' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_CORE_NAMES])
