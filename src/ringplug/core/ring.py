"""Bandwidth-optimal ring collectives over MPI point-to-point.

A ring allreduce is a reduce-scatter (n-1 steps, each rank reduces one chunk it receives
from its left neighbour) followed by an allgather (n-1 steps passing finished chunks on).
Every rank sends and receives 2(n-1)/n of the buffer, the minimum possible. Chunks are
moved in segments that fit the L2 cache, so the received data is still cached when it is
reduced. All buffers here are flat, contiguous arrays in their storage type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .dtypes import DType
from .ops import ReduceOp
from .reduce import combine

if TYPE_CHECKING:
    from mpi4py import MPI

RING_TAG = 7001


def even_bounds(count: int, parts: int, unit: int = 1) -> list[int]:
    """Split `count` elements into `parts` chunks made of whole `unit`s; earlier chunks get
    the extra units. Returns the parts+1 element offsets."""
    units = count // unit
    base, extra = divmod(units, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + (base + (1 if i < extra else 0)) * unit)
    return bounds


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint8)


def reduce_scatter(
    comm: MPI.Comm,
    buf: np.ndarray,
    bounds: list[int],
    op: ReduceOp,
    code: DType,
    scratch: np.ndarray,
    owner_shift: int,
) -> None:
    """Ring reduce-scatter in place: afterwards chunk (rank + 1 - owner_shift) % n of `buf`
    holds the reduction over all ranks. `scratch` is a uint8 work buffer (one segment)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    itemsize = buf.dtype.itemsize
    segment = max(1, scratch.nbytes // itemsize)
    longest = max(bounds[i + 1] - bounds[i] for i in range(size))
    segments = max(1, -(-longest // segment))  # the same count on every rank
    work = scratch[: segment * itemsize].view(buf.dtype)
    for step in range(size - 1):
        send_index = (rank - step - owner_shift) % size
        recv_index = (rank - step - 1 - owner_shift) % size
        send = buf[bounds[send_index] : bounds[send_index + 1]]
        recv = buf[bounds[recv_index] : bounds[recv_index + 1]]
        for k in range(segments):
            lo, hi = k * segment, (k + 1) * segment
            outgoing, incoming = send[lo:hi], recv[lo:hi]
            landing = work[: len(incoming)]
            comm.Sendrecv(_bytes(outgoing), right, RING_TAG, _bytes(landing), left, RING_TAG)
            if len(incoming):
                combine(incoming, landing, op, code)


def allgather_chunks(comm: MPI.Comm, buf: np.ndarray, bounds: list[int], owner_shift: int) -> None:
    """Ring allgather in place: each rank starts owning chunk (rank + 1 - owner_shift) % n
    and ends with every chunk."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_index = (rank + 1 - owner_shift - step) % size
        recv_index = (rank - owner_shift - step) % size
        send = buf[bounds[send_index] : bounds[send_index + 1]]
        recv = buf[bounds[recv_index] : bounds[recv_index + 1]]
        comm.Sendrecv(_bytes(send), right, RING_TAG, _bytes(recv), left, RING_TAG)


def allreduce(
    comm: MPI.Comm, buf: np.ndarray, op: ReduceOp, code: DType, scratch: np.ndarray
) -> None:
    """Ring allreduce of the flat array `buf` in place."""
    bounds = even_bounds(buf.size, comm.Get_size())
    reduce_scatter(comm, buf, bounds, op, code, scratch, owner_shift=0)
    allgather_chunks(comm, buf, bounds, owner_shift=0)
