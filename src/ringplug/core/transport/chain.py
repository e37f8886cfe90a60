"""A pipelined chain broadcast: the root's buffer passes rank to rank in segments.

Rank root + 1 receives segment k from the root and forwards it to root + 2 while segment
k + 1 arrives, and so on round the ranks: each rank receives and sends every byte once, so
a large buffer costs about n / bandwidth plus (p - 2 + segments) segment steps, where a
binomial tree (MPI's Bcast, usually) sends the whole buffer log2 p times from the root.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .traffic import DATA

if TYPE_CHECKING:
    from mpi4py import MPI

    from .waiting import Waiter

CHAIN_TAG = 7003


def broadcast(
    comm: MPI.Comm, data: np.ndarray, root: int, segment: int, waiter: Waiter | None = None
) -> None:
    """data <- root's data, in place (`data`: flat uint8; `segment`: bytes per message)."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1 or data.size == 0:
        return
    position = (rank - root) % size  # 0 at the root
    left, right = (rank - 1) % size, (rank + 1) % size
    last = position == size - 1
    bounds = list(range(0, data.size, segment)) + [data.size]
    pieces = [data[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]
    receives = [] if position == 0 else [comm.Irecv(p, left, CHAIN_TAG) for p in pieces]
    sends = []
    for k, piece in enumerate(pieces):
        if receives:
            _wait(waiter, [receives[k]], f"chain broadcast: segment {k + 1} from rank {left}")
        if not last:
            sends.append(comm.Isend(piece, right, CHAIN_TAG))
            if waiter is not None:
                waiter.traffic.sent(DATA, piece.nbytes)
    if sends:
        if waiter is None:
            MPI.Request.Waitall(sends)
        else:
            waiter.wait_requests(sends, f"chain broadcast: the segments to rank {right}")


def _wait(waiter: Waiter | None, requests: list[MPI.Request], phase: str) -> None:
    from mpi4py import MPI

    if waiter is None:
        MPI.Request.Waitall(requests)
    else:
        waiter.wait_requests(requests, phase)
