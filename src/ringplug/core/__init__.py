"""ringplug's framework-neutral core: runtime, engine, collectives on CPU buffers, MPI transport.

This layer knows buffers, never framework tensor types, and is the only one that talks MPI.
"""

# What this imports is the public API, whose names are listed once, in ringplug/_public.py
# (tests/test_import.py checks that the two agree).
from .. import _public
from .collectives import join, poll, start_timeline, stop_timeline, synchronize
from .dtypes import DType
from .engine.handles import Handle
from .errors import (
    BarrierTimeoutError,
    MismatchError,
    NotInitializedError,
    PeerArgumentError,
    PeerEngineFailedError,
    PeerFailedError,
    PeerLeftError,
    RingplugError,
    StallError,
)
from .kinds.allgather import allgather, allgather_async
from .kinds.allreduce import (
    allreduce,
    allreduce_async,
    grouped_allreduce,
    grouped_allreduce_async,
)
from .kinds.alltoall import alltoall, alltoall_async
from .kinds.barrier import barrier, barrier_async
from .kinds.broadcast import broadcast, broadcast_async
from .kinds.objects import allgather_object, broadcast_object
from .kinds.reducescatter import reducescatter, reducescatter_async
from .ops import Average, Max, Min, Product, ReduceOp, Sum
from .process_sets import ProcessSet, add_process_set, remove_process_set
from .runtime import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

__all__ = [*_public.__all__]
