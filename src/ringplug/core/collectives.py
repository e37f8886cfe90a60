"""The collectives users call: `ringplug.allreduce(array)`, `ringplug.allreduce_async(...)`, ...
(each kind's defined in its module under `kinds`, and reached from here).

They take numpy arrays or anything with the buffer protocol. Each has an async form that
returns a `Handle` at once; the plain form is the async form followed by `wait()`. Every
rank must submit the same collectives: matched by `name`, or, for unnamed calls, by the
order of the calls (they get the names "noname.1", "noname.2", ... on every rank). When
shapes, dtypes, ops or roots differ between ranks, every rank's handle raises
`ringplug.MismatchError` saying who passed what. Bad arguments on one rank raise there and
raise `PeerArgumentError` on the others; no rank is left waiting.
"""

from __future__ import annotations

from typing import Any

from . import runtime
from .engine.handles import Handle

# The adapters (ringplug.torch, the Horovod layer) reach every kind through this module.
from .kinds.adasum import adasum, adasum_async, grouped_adasum_async
from .kinds.allgather import allgather, allgather_async, allgather_in_place_async
from .kinds.allreduce import (
    allreduce,
    allreduce_async,
    grouped_allreduce,
    grouped_allreduce_async,
)
from .kinds.alltoall import alltoall, alltoall_async
from .kinds.barrier import barrier, barrier_async
from .kinds.base import check_root, reject
from .kinds.broadcast import broadcast, broadcast_async
from .kinds.objects import allgather_object, broadcast_object
from .kinds.reducescatter import (
    reducescatter,
    reducescatter_async,
    reducescatter_in_place_async,
)


def poll(handle: Handle) -> bool:
    """Whether the collective behind `handle` has finished; never blocks."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for the collective behind `handle`; return its result or raise its error."""
    return handle.wait()


def join() -> int:
    """Declare that this rank has run out of data, and wait until every rank has.

    Until then this rank takes part in the other ranks' collectives with a contribution
    that changes nothing (zeros for Sum and Average, which still divides by the full
    number of ranks; +inf/-inf/1 for Min/Max/Product). Returns the rank that joined last,
    the same on every rank.
    """
    return runtime.engine().join().wait()


def start_timeline(path: str) -> None:
    """Start writing a Chrome trace of the engine to `path` (rank 0 writes it)."""
    runtime.engine().start_timeline(path)


def stop_timeline() -> None:
    """Finish the timeline file (it is valid JSON from then on)."""
    runtime.engine().stop_timeline()
