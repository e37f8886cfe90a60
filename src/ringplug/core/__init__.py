"""ringplug's framework-neutral core: runtime, engine, collectives on CPU buffers, MPI transport.

This layer knows buffers, never framework tensor types, and is the only one that talks MPI.
"""

from .collectives import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    barrier_async,
    broadcast,
    broadcast_async,
    broadcast_object,
    grouped_allreduce,
    grouped_allreduce_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from .dtypes import DType
from .engine import Handle
from .errors import (
    MismatchError,
    NotInitializedError,
    PeerArgumentError,
    PeerFailedError,
    PeerLeftError,
    RingplugError,
    StallError,
)
from .ops import Average, Max, Min, Product, ReduceOp, Sum
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

__all__ = [
    "Average", "DType", "Handle", "Max", "Min", "MismatchError",
    "NotInitializedError", "PeerArgumentError", "PeerFailedError", "PeerLeftError",
    "Product", "ReduceOp", "RingplugError",
    "StallError", "Sum", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_async", "alltoall", "alltoall_async", "barrier", "barrier_async", "broadcast",
    "broadcast_async", "broadcast_object", "cross_rank", "cross_size", "grouped_allreduce",
    "grouped_allreduce_async", "init", "is_initialized", "join", "local_rank", "local_size",
    "poll", "rank", "reducescatter", "reducescatter_async", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize",
]  # fmt: skip
