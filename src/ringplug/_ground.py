"""The core's ground floor for ringrun's side: ``ringplug.core.config`` and ``.wire`` without
the rest of the core.

``import ringplug.core.config`` runs ``ringplug/core/__init__.py`` first, which loads the
whole core and numpy (measured: ringrun's import went from 0.13 s to 1.3 s, the per-rank
wrapper's from 0.09 s to 0.8-1.2 s, on the 2-core CI machine). ringrun, its per-rank wrapper
and the forensics need only these two modules, which import nothing but the standard
library; :func:`ground` loads one of them under its own name, ``ringplug.core.<name>``, so a
later import of the core finds it there and uses the same module (one ``Settings`` class,
one set of declarations). When the core is already loaded (or loading) it is the ordinary
import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_FLOOR = ("config", "wire")


def ground(name: str) -> ModuleType:
    """The module ``ringplug.core.<name>`` (``config`` or ``wire``), loaded without the core's
    package when that is not loaded yet."""
    if name not in _FLOOR:
        raise ValueError(f"ringplug.core.{name} is not on the core's ground floor {_FLOOR}")
    full = f"ringplug.core.{name}"
    module = sys.modules.get(full)
    if module is not None:
        return module
    if "ringplug.core" in sys.modules:
        return importlib.import_module(full)
    path = Path(__file__).with_name("core") / f"{name}.py"
    spec = importlib.util.spec_from_file_location(full, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        raise
    return module


wire = ground("wire")
config = ground("config")
