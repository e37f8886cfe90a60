"""Small allreduces that travel inside the negotiation message (`engine/carried.py`).

A small host allreduce of a name the ranks agreed on before carries its data, prescaled,
in the cycle's message; when every rank's message carries it, each rank reduces the copies
itself, in rank order, with the ring's kernels: the allreduce costs no collective of its
own, and every rank computes the same result bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ....wire import HOST, Signature
from ...dtypes import DType
from ...ops import ReduceOp
from ...transport import reduce

if TYPE_CHECKING:
    from ...engine.handles import Request


def size_of(signature: Signature, threshold: int) -> int:
    """The bytes an allreduce of `signature` carries in a message, or 0 when it never does
    (on the GPU, or larger than `threshold`)."""
    if signature.place != HOST:
        return 0
    nbytes = math.prod(signature.shape) * DType(signature.code).itemsize
    return nbytes if 0 < nbytes <= threshold else 0


def pieces(request: Request) -> list[np.ndarray]:
    """What a message carries of `request`: its arrays one after the other (a grouped
    allreduce has several), prescaled, as flat contiguous arrays that the message's
    `b"".join` reads as bytes. The caller's arrays themselves unless scaled: encoding the
    message copies them, so that an allreduce in place cannot change this rank's copy while
    the copies are reduced."""
    reduction = request.payload
    if reduction.prescale == 1.0:
        return reduction.sends  # not changed by the message: it copies them
    scaled = []
    for send in reduction.sends:
        send = send.copy()
        reduce.scale(send, reduction.prescale, DType(request.signature.code))
        scaled.append(send)
    return scaled


def reduce_into(
    outs: list[np.ndarray],
    copies: Sequence[bytes | bytearray | memoryview],
    op: ReduceOp,
    code: DType,
    offset: int = 0,
) -> None:
    """Each of `outs` <- its part of every rank's copy, combined in rank order with the
    ring's kernels (`reduce`); `outs` lie one after the other in each copy, from byte
    `offset` on."""
    if len(outs) == 1:  # one array (the usual request): each copy whole, no slices
        out = outs[0]
        count, storage = out.size, out.dtype  # outs are in the storage type
        first = np.frombuffer(copies[0], storage, count, offset)
        second = np.frombuffer(copies[1], storage, count, offset)
        if code in reduce.WIDENED:
            reduce.combine_into(out, first, second, op, code)
        else:  # `combine_into`'s own case, written out: a synchronous call's usual one
            reduce.UFUNCS[op](first, second, out=out)
        for copy in copies[2:]:
            reduce.combine(out, np.frombuffer(copy, storage, count, offset), op, code)
        return
    storage = code.storage
    count = sum(out.size for out in outs)
    arrays = [np.frombuffer(copy, storage, count, offset) for copy in copies]
    start = 0
    for out in outs:
        parts = [a[start : start + out.size] for a in arrays]
        start += out.size
        reduce.combine_into(out, parts[0], parts[1], op, code)
        for other in parts[2:]:
            reduce.combine(out, other, op, code)
