"""ringplug: data-parallel training for Lightning and Keras over ring-allreduce.

``import ringplug`` loads no ML framework and does not start MPI; `ringplug.init()` does.
"""

from .core import (
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
)

__version__ = "0.1.0"

__all__ = [
    "Average", "DType", "Max", "Min", "MismatchError", "NotInitializedError",
    "PeerArgumentError", "Product", "ReduceOp", "RingplugError", "Sum", "__version__",
    "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_object", "cross_rank", "cross_size", "init", "is_initialized", "local_rank",
    "local_size", "rank", "reducescatter", "shutdown", "size",
]
