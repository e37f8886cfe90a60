"""ringplug for PyTorch: collectives on tensors and starting every rank from the same state.

``import ringplug.torch`` imports torch and registers the ``ringplug`` backend of
torch.distributed (`ringplug.torch.backend`); ``import ringplug`` alone never does.

Example:
    >>> import torch, ringplug.torch as rpt  # doctest: +SKIP
    >>> rpt.init()                        # and cuda:LOCAL_RANK is torch's current device
    >>> rpt.broadcast_parameters(model.state_dict(), root_rank=0)
    >>> rpt.allreduce_(loss_sum, op="sum")
"""

from ..compression import Compression
from ..core import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from . import backend as _backend
from . import cuda as _cuda
from .agreement import RanksDisagreeError, check_agreement
from .collectives import (
    TensorHandle,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from .device import init
from .optimizer import DistributedOptimizer
from .state import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .sync_batchnorm import SyncBatchNorm

_backend.register()  # torch.distributed.init_process_group("ringplug")
_cuda.register()  # the GPU data plane uses torch's streams, events and allocator

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Max",
    "Min",
    "Product",
    "RanksDisagreeError",
    "Sum",
    "SyncBatchNorm",
    "TensorHandle",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "check_agreement",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "shutdown",
    "size",
]
