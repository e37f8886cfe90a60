"""Bandwidth-optimal ring collectives over MPI point-to-point.

A ring allreduce is a reduce-scatter (n-1 steps, each rank reduces one chunk it receives
from its left neighbour) followed by an allgather (n-1 steps passing finished chunks on).
Every rank sends and receives 2(n-1)/n of the buffer, the minimum possible. Chunks are
moved in segments that fit the L2 cache, so the received data is still cached when it is
reduced. All buffers here are flat, contiguous arrays in their storage type.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np

from ..dtypes import DType
from ..ops import ReduceOp
from .reduce import combine, scale
from .traffic import DATA

if TYPE_CHECKING:
    from mpi4py import MPI

    from .waiting import Waiter

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


class Pieces:
    """A flat buffer made of several flat arrays of one dtype, in order.

    The ring works on the concatenation without building it: a range that spans several
    arrays travels as one message per array, so fused tensors are never copied into a
    fusion buffer.
    """

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = [a for a in arrays if a.size]
        self.starts = [0]
        for array in self.arrays:
            self.starts.append(self.starts[-1] + array.size)
        self.size = self.starts[-1]
        self.dtype = arrays[0].dtype if arrays else np.dtype(np.uint8)

    def views(self, lo: int, hi: int) -> list[np.ndarray]:
        """The parts of elements [lo, hi) as views into the arrays."""
        out: list[np.ndarray] = []
        index = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while lo < hi and index < len(self.arrays):
            start = self.starts[index]
            end = min(hi, self.starts[index + 1])
            if end > lo:
                out.append(self.arrays[index][lo - start : end - start])
                lo = end
            index += 1
        return out


def _exchange(
    comm: MPI.Comm,
    outgoing: list[np.ndarray],
    incoming: list[np.ndarray],
    right: int,
    left: int,
    waiter: Waiter | None,
    phase: str,
) -> None:
    """Send `outgoing` to the right neighbour and receive `incoming` from the left one.

    Every rank lays the fused tensors out alike, so both ends of a message cut a range at
    the same tensor boundaries: one message per piece, each contiguous, and MPI moves it
    with a single copy (a derived datatype would be packed and unpacked instead). The
    nonblocking forms are waited for by `waiter`, with its deadline (a blocking `Sendrecv`
    to a frozen neighbour would never return).
    """
    from mpi4py import MPI

    requests = [comm.Irecv(part.view(np.uint8), left, RING_TAG) for part in incoming]
    requests += [comm.Isend(part.view(np.uint8), right, RING_TAG) for part in outgoing]
    if waiter is None:
        MPI.Request.Waitall(requests)
    else:
        waiter.traffic.sent(DATA, sum(part.nbytes for part in outgoing), len(outgoing))
        waiter.wait_requests(requests, f"{phase}: receiving from rank {left}, sending to {right}")


def split(flat: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """`flat` cut into consecutive views of `counts` elements each."""
    out, offset = [], 0
    for count in counts:
        out.append(flat[offset : offset + count])
        offset += count
    return out


def _as_pieces(buf: np.ndarray | Pieces) -> Pieces:
    return buf if isinstance(buf, Pieces) else Pieces([buf])


def reduce_scatter(
    comm: MPI.Comm,
    buf: np.ndarray | Pieces,
    bounds: list[int],
    op: ReduceOp,
    code: DType,
    scratch: np.ndarray,
    owner_shift: int,
    postscale: float = 1.0,
    waiter: Waiter | None = None,
) -> None:
    """Ring reduce-scatter in place: afterwards chunk (rank + 1 - owner_shift) % n of `buf`
    holds the reduction over all ranks, times `postscale` (applied to each segment as it is
    finished, while it is still in cache). `scratch` is a uint8 work buffer (one segment)."""
    pieces = _as_pieces(buf)
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    itemsize = pieces.dtype.itemsize
    segment = max(1, scratch.nbytes // itemsize)
    longest = max(bounds[i + 1] - bounds[i] for i in range(size))
    segments = max(1, -(-longest // segment))  # the same count on every rank
    work = scratch[: segment * itemsize].view(pieces.dtype)
    for step in range(size - 1):
        send_index = (rank - step - owner_shift) % size
        recv_index = (rank - step - 1 - owner_shift) % size
        send_lo, send_hi = bounds[send_index], bounds[send_index + 1]
        recv_lo, recv_hi = bounds[recv_index], bounds[recv_index + 1]
        for k in range(segments):
            s_lo, s_hi = (
                min(send_lo + k * segment, send_hi),
                min(send_lo + (k + 1) * segment, send_hi),
            )
            r_lo, r_hi = (
                min(recv_lo + k * segment, recv_hi),
                min(recv_lo + (k + 1) * segment, recv_hi),
            )
            landing = work[: r_hi - r_lo]
            targets = pieces.views(r_lo, r_hi)
            arrivals = split(landing, [part.size for part in targets])
            _exchange(
                comm,
                pieces.views(s_lo, s_hi),
                arrivals,
                right,
                left,
                waiter,
                f"ring reduce-scatter step {step + 1} of {size - 1}",
            )
            last = step == size - 2
            for part, arrived in zip(targets, arrivals, strict=True):
                combine(part, arrived, op, code)
                if last and postscale != 1.0:
                    scale(part, postscale, code)


def allgather_chunks(
    comm: MPI.Comm,
    buf: np.ndarray | Pieces,
    bounds: list[int],
    owner_shift: int,
    waiter: Waiter | None = None,
) -> None:
    """Ring allgather in place: each rank starts owning chunk (rank + 1 - owner_shift) % n
    and ends with every chunk."""
    pieces = _as_pieces(buf)
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_index = (rank + 1 - owner_shift - step) % size
        recv_index = (rank - owner_shift - step) % size
        outgoing = pieces.views(bounds[send_index], bounds[send_index + 1])
        incoming = pieces.views(bounds[recv_index], bounds[recv_index + 1])
        _exchange(
            comm,
            outgoing,
            incoming,
            right,
            left,
            waiter,
            f"ring allgather step {step + 1} of {size - 1}",
        )


def allreduce(
    comm: MPI.Comm,
    buf: np.ndarray | Pieces,
    op: ReduceOp,
    code: DType,
    scratch: np.ndarray,
    postscale: float = 1.0,
    waiter: Waiter | None = None,
) -> None:
    """Ring allreduce in place of a flat array, or of several (`Pieces`) as one; the result
    is multiplied by `postscale` (by each chunk's owner, before the allgather: no extra pass
    over the whole buffer)."""
    pieces = _as_pieces(buf)
    bounds = even_bounds(pieces.size, comm.Get_size())
    reduce_scatter(comm, pieces, bounds, op, code, scratch, 0, postscale, waiter)
    allgather_chunks(comm, pieces, bounds, 0, waiter)
