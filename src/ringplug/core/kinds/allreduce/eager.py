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


def pieces(request: Request) -> list[memoryview]:
    """What a message carries of `request`, as bytes: its arrays one after the other (a
    grouped allreduce has several), prescaled. Views of the caller's arrays unless scaled:
    encoding the message copies them, so that an allreduce in place cannot change this
    rank's copy while the copies are reduced."""
    reduction = request.payload
    sends = reduction.sends
    if reduction.prescale == 1.0:
        if len(sends) == 1:  # the usual request: no list comprehension (a call)
            return [sends[0].data.cast("B")]
        return [send.data.cast("B") for send in sends]
    scaled = []
    for send in sends:
        send = send.copy()
        reduce.scale(send, reduction.prescale, DType(request.signature.code))
        scaled.append(send.data.cast("B"))
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
