"""ringplug: data-parallel training for Lightning and Keras over ring-allreduce.

``import ringplug`` is cheap: it loads no ML framework, not even numpy, and does not start
MPI. The core's names (`ringplug.init`, `ringplug.allreduce`, ...) load on first use
(PEP 562), and `ringplug.init()` is what starts MPI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_CORE_NAMES = (
    "Average", "DType", "Handle", "Max", "Min", "MismatchError",
    "NotInitializedError", "PeerArgumentError", "Product", "ReduceOp", "RingplugError",
    "StallError", "Sum", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_async", "alltoall", "barrier", "broadcast", "broadcast_async",
    "broadcast_object", "cross_rank", "cross_size", "grouped_allreduce",
    "grouped_allreduce_async", "init", "is_initialized", "join", "local_rank", "local_size",
    "poll", "rank", "reducescatter", "reducescatter_async", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize",
)  # fmt: skip

__all__ = ["__version__", *_CORE_NAMES]

if TYPE_CHECKING:
    from .core import *  # noqa: F403


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
