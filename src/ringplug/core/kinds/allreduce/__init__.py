"""Allreduce: every rank gets the elementwise reduction of every rank's array.

The whole kind lives here: `requests` (the request builder with its fast path, the grouped
and GPU forms, and their blocking forms), `collective` (the kind object the
engine runs it through), `fusion` (fused batches and the fusion buffer), `eager` (small
allreduces carried in the negotiation message).
"""

from . import collective
from .requests import (
    allreduce,
    allreduce_async,
    gpu_allreduce_async,
    grouped_allreduce,
    grouped_allreduce_async,
)

__all__ = [
    "allreduce",
    "allreduce_async",
    "collective",
    "gpu_allreduce_async",
    "grouped_allreduce",
    "grouped_allreduce_async",
]
