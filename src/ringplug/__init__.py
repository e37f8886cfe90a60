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
    "Average", "DType", "Max", "Min", "MismatchError", "NotInitializedError",
    "PeerArgumentError", "Product", "ReduceOp", "RingplugError", "Sum", "allgather",
    "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_object",
    "cross_rank", "cross_size", "init", "is_initialized", "local_rank", "local_size", "rank",
    "reducescatter", "shutdown", "size",
)  # fmt: skip

__all__ = ["__version__", *_CORE_NAMES]

if TYPE_CHECKING:
    from .core import (  # noqa: F401
        Average,
        DType,
        Max,
        Min,
        MismatchError,
        NotInitializedError,
        PeerArgumentError,
        Product,
        ReduceOp,
        RingplugError,
        Sum,
        allgather,
        allgather_object,
        allreduce,
        alltoall,
        barrier,
        broadcast,
        broadcast_object,
        cross_rank,
        cross_size,
        init,
        is_initialized,
        local_rank,
        local_size,
        rank,
        reducescatter,
        shutdown,
        size,
    )  # fmt: skip


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
