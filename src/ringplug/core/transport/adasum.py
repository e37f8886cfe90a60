"""Adasum: adaptive summation of every rank's vectors (Maleki et al., MLSys 2021).

Two vectors a and b combine as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(their sum when they are orthogonal, their average when they are parallel), separately for
each tensor of a fused buffer, and the ranks combine pairwise in a tree: at level l (1, 2,
4, ...) the result of ranks [k, k + l) is `a` and that of [k + l, k + 2l) is `b`, for
k a multiple of 2l. The number of ranks must therefore be a power of two.

The data moves as a recursive halving (distance doubling): at level l a rank swaps half of
the range it holds with the rank whose number differs in bit l, so that each of the two
keeps its half of both vectors, then combines the halves. The dot products and squared
norms are of whole tensors: each rank's partial sums (float64, over its piece) are added up
over the 2l ranks that hold the pieces of the two vectors, by recursive doubling, so that
every one of them gets the same coefficients bit for bit. Once every level has run, each
rank holds 1/p of the result; the same exchanges in reverse gather it back. A rank sends
about 2n bytes for n bytes of data, as the ring does, plus 24 bytes per tensor per step for
the sums.

A vector whose squared norm is below sqrt(DBL_MIN) takes the coefficient 1 (the formula
would divide by almost zero), as in Horovod.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .traffic import DATA

if TYPE_CHECKING:
    from mpi4py import MPI

    from .waiting import Waiter

ADASUM_TAG = 7003
# Below this squared norm a vector keeps the coefficient 1 (Horovod's sqrt(DBL_MIN)).
_TINY_NORM_SQUARED = math.sqrt(np.finfo(np.float64).tiny)


def is_power_of_two(size: int) -> bool:
    return size > 0 and size & (size - 1) == 0


def unsupported_size(size: int) -> str | None:
    """Why Adasum cannot run on `size` ranks, or None when it can."""
    if is_power_of_two(size):
        return None
    below = 1 << (size.bit_length() - 1)
    return (
        f"Adasum combines the ranks pairwise in a binary tree, so it needs a power of two "
        f"ranks (1, 2, 4, 8, ...); this job has {size}. Run on {below} or {below * 2} ranks, "
        "or use op=Average (with the linear scaling rule) or op=Sum instead."
    )


def coefficients(dot: float, a_norm_squared: float, b_norm_squared: float) -> tuple[float, float]:
    """The factors of a and b in their Adasum, from the whole vectors' dot product and
    squared norms."""
    a_factor = 1.0 - 0.5 * dot / a_norm_squared if a_norm_squared >= _TINY_NORM_SQUARED else 1.0
    b_factor = 1.0 - 0.5 * dot / b_norm_squared if b_norm_squared >= _TINY_NORM_SQUARED else 1.0
    return a_factor, b_factor


def allreduce(
    comm: MPI.Comm | None, buf: np.ndarray, bounds: Sequence[int], waiter: Waiter | None = None
) -> None:
    """buf <- the Adasum of every rank's buf, in place; `buf` is flat (float16, float32 or
    float64) and holds several tensors, tensor i in [bounds[i], bounds[i + 1])."""
    size = comm.Get_size() if comm is not None else 1
    if size == 1 or buf.size == 0:
        return
    rank = comm.Get_rank()
    if not is_power_of_two(size):
        raise ValueError(unsupported_size(size))
    lo, hi = 0, buf.size
    held: list[tuple[int, int, int, int]] = []  # per level: partner's range, then own range
    incoming = np.empty(buf.size - buf.size // 2, buf.dtype)
    level = 1
    while level < size:
        partner = rank ^ level
        middle = lo + (hi - lo) // 2
        lower = rank & level == 0  # this rank's vector is `a` at this level
        keep = (lo, middle) if lower else (middle, hi)
        give = (middle, hi) if lower else (lo, middle)
        theirs = incoming[: keep[1] - keep[0]]
        _swap(
            comm,
            buf[give[0] : give[1]],
            theirs,
            partner,
            waiter,
            f"Adasum level {level.bit_length()} of {size.bit_length() - 1}",
        )
        held.append((give[0], give[1], keep[0], keep[1]))
        lo, hi = keep
        mine = buf[lo:hi]
        a, b = (mine, theirs) if lower else (theirs, mine)
        sums = _partial_sums(a, b, bounds, lo, hi)
        _sum_over_block(comm, sums, rank, level, waiter)
        _combine_tensors(mine, theirs, lower, sums, bounds, lo, hi)
        level <<= 1
    for step in reversed(range(len(held))):
        give_lo, give_hi, keep_lo, keep_hi = held[step]
        _swap(
            comm,
            buf[keep_lo:keep_hi],
            buf[give_lo:give_hi],
            rank ^ (1 << step),
            waiter,
            "Adasum: gathering the result",
        )


def _tensors_in(bounds: Sequence[int], lo: int, hi: int) -> range:
    """The indices of the tensors that overlap [lo, hi)."""
    first = int(np.searchsorted(bounds, lo, side="right")) - 1
    last = int(np.searchsorted(bounds, hi, side="left"))
    return range(max(first, 0), min(last, len(bounds) - 1))


def _partial_sums(
    a: np.ndarray, b: np.ndarray, bounds: Sequence[int], lo: int, hi: int
) -> np.ndarray:
    """Per tensor: (a.b, |a|^2, |b|^2) over the part of it in [lo, hi), in float64 (zeros
    for the tensors outside)."""
    sums = np.zeros((len(bounds) - 1, 3), np.float64)
    for index in _tensors_in(bounds, lo, hi):
        start, stop = max(bounds[index], lo) - lo, min(bounds[index + 1], hi) - lo
        if start >= stop:
            continue
        x = a[start:stop].astype(np.float64, copy=False)
        y = b[start:stop].astype(np.float64, copy=False)
        sums[index] = (np.dot(x, y), np.dot(x, x), np.dot(y, y))
    return sums


def _combine_tensors(
    mine: np.ndarray,
    theirs: np.ndarray,
    lower: bool,
    sums: np.ndarray,
    bounds: Sequence[int],
    lo: int,
    hi: int,
) -> None:
    """mine <- Adasum of each tensor's piece in [lo, hi) (`lower`: mine is `a`)."""
    for index in _tensors_in(bounds, lo, hi):
        start, stop = max(bounds[index], lo) - lo, min(bounds[index + 1], hi) - lo
        if start >= stop:
            continue
        a_factor, b_factor = coefficients(*sums[index])
        if not lower:  # this rank's piece is `b`
            a_factor, b_factor = b_factor, a_factor
        # In float64, rounded once to the tensor's dtype.
        wide = a_factor * mine[start:stop].astype(np.float64, copy=False)
        wide += b_factor * theirs[start:stop].astype(np.float64, copy=False)
        np.copyto(mine[start:stop], wide, casting="unsafe")


def _sum_over_block(
    comm: MPI.Comm, sums: np.ndarray, rank: int, level: int, waiter: Waiter | None
) -> None:
    """sums <- the sum of `sums` over the 2 * level ranks whose numbers differ from this
    one's in the bits below 2 * level (recursive doubling). The two ranks of each exchange
    add the same two numbers, so all of them end with the same values bit for bit."""
    other = np.empty_like(sums)
    bit = 1
    while bit <= level:
        _swap(comm, sums, other, rank ^ bit, waiter, "Adasum: adding up dot products and norms")
        sums += other
        bit <<= 1


def _swap(
    comm: MPI.Comm,
    outgoing: np.ndarray,
    incoming: np.ndarray,
    peer: int,
    waiter: Waiter | None,
    phase: str,
) -> None:
    """Send `outgoing` to `peer` and receive `incoming` from it."""
    from mpi4py import MPI

    requests = [
        comm.Irecv(incoming.view(np.uint8), peer, ADASUM_TAG),
        comm.Isend(outgoing.view(np.uint8), peer, ADASUM_TAG),
    ]
    if waiter is None:
        MPI.Request.Waitall(requests)
        return
    waiter.traffic.sent(DATA, outgoing.nbytes)
    waiter.wait_requests(requests, f"{phase}: with rank {peer}")
