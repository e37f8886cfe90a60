"""Collectives on GPU buffers, for the framework adapters (torch, TensorFlow, JAX): the GPU
builders of the kinds modules, under the names the adapters call.

Adapters describe their tensors as `DeviceBuffer`s and pass the event after which the
inputs are ready (or None when they synchronised). Everything that could make one rank
unable to run the collective is checked here, before negotiation, so that a refusal on
one rank fails the matching call on every rank instead of leaving them inside NCCL.
"""

from __future__ import annotations

from .kinds.allgather import gpu_allgather_async as allgather_async
from .kinds.allreduce import gpu_allreduce_async as allreduce_async
from .kinds.base import check_buffers
from .kinds.broadcast import gpu_broadcast_async as broadcast_async
from .kinds.reducescatter import gpu_reducescatter_async as reducescatter_async

__all__ = [
    "allgather_async",
    "allreduce_async",
    "broadcast_async",
    "check_buffers",
    "reducescatter_async",
]
