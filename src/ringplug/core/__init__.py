"""ringplug's framework-neutral core: runtime, collectives on CPU buffers, MPI transport.

This layer knows buffers, never framework tensor types, and is the only one that talks MPI.
"""

from .collectives import (
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    reducescatter,
)
from .dtypes import DType
from .errors import MismatchError, NotInitializedError, PeerArgumentError, RingplugError
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
    "Average",
    "DType",
    "Max",
    "Min",
    "MismatchError",
    "NotInitializedError",
    "PeerArgumentError",
    "Product",
    "ReduceOp",
    "RingplugError",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "shutdown",
    "size",
]
