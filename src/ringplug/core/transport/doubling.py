"""Recursive doubling: the allreduce of small buffers in ceil(log2 p) steps.

In step k every rank swaps its partial result with the rank whose number differs in bit k
and combines the two: after log2 p steps each holds the reduction over all ranks. A rank
sends n bytes per step, n log2 p in all, where the ring sends 2n (p - 1) / p in 2 (p - 1)
steps: below a crossover the steps' latency is what costs, and doubling pays fewer.

When p is not a power of two, the first 2r ranks (r = p minus the largest power of two
below it) pair up first: each even one hands its buffer to the odd one after it, sits out
the doubling, and gets the result back at the end (two steps more for it, one for the odd
rank).

Both ranks of a pair combine the lower-numbered group's partial first, so every rank
computes the same values bit for bit, as the ring does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..dtypes import DType
from ..ops import ReduceOp
from .reduce import combine
from .traffic import DATA

if TYPE_CHECKING:
    from mpi4py import MPI

    from .waiting import Waiter

DOUBLING_TAG = 7002


def steps(rank: int, size: int) -> tuple[int | None, list[int], bool]:
    """The exchanges of `rank` among `size` ranks: (the partner of the pairing-up step, or
    None; the partners of the doubling steps in order, empty for a rank that sits out;
    whether this rank sits out and gets the result from its partner)."""
    lower = 1 << (size.bit_length() - 1)  # the largest power of two <= size
    extra = size - lower
    if rank < 2 * extra:
        if rank % 2 == 0:
            return rank + 1, [], True
        pairing, virtual = rank - 1, rank // 2
    else:
        pairing, virtual = None, rank - extra
    partners = []
    mask = 1
    while mask < lower:
        other = virtual ^ mask
        partners.append(2 * other + 1 if other < extra else other + extra)
        mask <<= 1
    return pairing, partners, False


def allreduce(
    comm: MPI.Comm, buf: np.ndarray, op: ReduceOp, code: DType, waiter: Waiter | None = None
) -> None:
    """buf <- the reduction over every rank's buf, in place (`op`: Sum, Product, Min or Max;
    `buf` flat, in the storage type of `code`)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1 or buf.size == 0:
        return
    pairing, partners, sits_out = steps(rank, size)
    data = buf.view(np.uint8)
    if sits_out:
        _swap(comm, data, None, pairing, waiter, "recursive doubling: handing over")
        _swap(comm, None, data, pairing, waiter, "recursive doubling: the result")
        return
    incoming = np.empty_like(buf)
    received = incoming.view(np.uint8)
    if pairing is not None:
        _swap(comm, None, received, pairing, waiter, "recursive doubling: pairing")
        _combine_in_order(buf, incoming, pairing < rank, op, code)
    for step, partner in enumerate(partners):
        _swap(
            comm,
            data,
            received,
            partner,
            waiter,
            f"recursive doubling step {step + 1} of {len(partners)}",
        )
        _combine_in_order(buf, incoming, partner < rank, op, code)
    if pairing is not None:
        _swap(comm, data, None, pairing, waiter, "recursive doubling: the result")


def _combine_in_order(
    buf: np.ndarray, other: np.ndarray, other_first: bool, op: ReduceOp, code: DType
) -> None:
    """buf <- the lower-numbered side's values (op) the other's."""
    if other_first:
        combine(other, buf, op, code)
        np.copyto(buf, other)
    else:
        combine(buf, other, op, code)


def _swap(
    comm: MPI.Comm,
    outgoing: np.ndarray | None,
    incoming: np.ndarray | None,
    peer: int,
    waiter: Waiter | None,
    phase: str,
) -> None:
    """Send `outgoing` to `peer` and receive `incoming` from it (either may be None)."""
    requests = []
    if incoming is not None:
        requests.append(comm.Irecv(incoming, peer, DOUBLING_TAG))
    if outgoing is not None:
        requests.append(comm.Isend(outgoing, peer, DOUBLING_TAG))
    if waiter is None:
        type(requests[0]).Waitall(requests)  # MPI.Request's, without importing it per step
        return
    if outgoing is not None:
        waiter.traffic.sent(DATA, outgoing.nbytes)
    waiter.wait_requests(requests, f"{phase}: with rank {peer}")
