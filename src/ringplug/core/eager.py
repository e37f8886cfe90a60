"""Small allreduces that travel inside the negotiation message ("eager" data).

A rank that has a small host allreduce ready, of a name the ranks agreed on before (it has
a cache slot), appends its data, prescaled, to the cycle's message. When every rank's
message of a cycle carries the data of a request, each rank reduces the copies itself, in
rank order, with the ring's kernels: the allreduce costs no collective of its own, and
every rank computes the same result bit for bit. Otherwise (a rank sent the request as new,
a rank has joined, the budget was spent before it) the request takes the usual path.

Which requests a message carries follows from its cached bits, its numbered requests and
the cache alone, so that every rank reads every message the same way: the eligible slots
(`Cache.eager_mask`) in slot order, then the eligible numbered requests in the message's
order, while their bytes fit in `RINGPLUG_EAGER_THRESHOLD` in all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import reduce
from .dtypes import DType
from .kind import HOST
from .ops import ReduceOp

if TYPE_CHECKING:
    from .handles import Request
    from .negotiation import Cache, Message, Signature


def size_of(signature: Signature, threshold: int) -> int:
    """The bytes a request of `signature` carries in a message, or 0 when it never does
    (not a host allreduce, one array or grouped, or larger than `threshold`)."""
    from .negotiation import Kind  # negotiation imports this module

    if signature.kind is not Kind.ALLREDUCE or signature.place != HOST:
        return 0
    nbytes = math.prod(signature.shape) * DType(signature.code).itemsize
    return nbytes if 0 < nbytes <= threshold else 0


def layout(message: Message, cache: Cache) -> list[tuple[str, int, int]]:
    """(name, offset, bytes) of each request `message` carries the data of: its eligible
    cached requests in slot order, then its numbered ones in its order, while they fit in
    the cache's `eager_threshold`.

    The last answer is kept in the cache (until it learns): a cycle asks it of this rank's
    message and then of the same form in every peer's.
    """
    memo = cache.last_layout
    if memo is not None and memo[0] == message.cached and memo[1] == message.numbered:
        return memo[2]
    carried = _layout(message, cache)
    cache.last_layout = (message.cached, list(message.numbered), carried)
    return carried


def _layout(message: Message, cache: Cache) -> list[tuple[str, int, int]]:
    budget = cache.eager_threshold
    carried = []
    offset = 0
    bits = message.cached & cache.eager_mask
    while bits:
        lowest = bits & -bits
        bits ^= lowest
        slot = lowest.bit_length() - 1
        nbytes = cache.eager_bytes[slot]
        if offset + nbytes > budget:
            return carried
        carried.append((cache.slots[slot][0], offset, nbytes))
        offset += nbytes
    for slot, number in message.numbered:
        nbytes = cache.eager_bytes[slot]
        if not nbytes:
            continue
        if offset + nbytes > budget:
            return carried
        carried.append((f"{cache.slots[slot][0]}{number}", offset, nbytes))
        offset += nbytes
    return carried


def pack(message: Message, pending: dict[str, Request], cache: Cache) -> bytes:
    """This rank's eager data for its `message` (`pending`: its requests by name)."""
    return b"".join(
        [piece for name, _, _ in layout(message, cache) for piece in pieces(pending[name])]
    )


def pieces(request: Request) -> list[memoryview]:
    """What a message carries of `request`, as bytes: its arrays one after the other (a
    grouped allreduce has several), prescaled. Views of the caller's arrays unless scaled:
    encoding the message copies them, so that an allreduce in place cannot change this
    rank's copy while the copies are reduced."""
    reduction = request.payload
    if reduction.prescale == 1.0:
        return [send.data.cast("B") for send in reduction.sends]
    scaled = []
    for send in reduction.sends:
        send = send.copy()
        reduce.scale(send, reduction.prescale, DType(request.signature.code))
        scaled.append(send.data.cast("B"))
    return scaled


def received(
    messages: list[Message], cache: Cache, repeated: bool = False
) -> dict[str, list[memoryview]]:
    """name -> every rank's data of it, in rank order, for the requests that every
    message of this cycle carries (read before the cache learns this cycle's plan);
    `repeated`: the plan found every message alike (`decide`)."""
    if not cache.eager_mask:
        return {}
    first = messages[0]
    if repeated or all(m.cached == first.cached and m.numbered == first.numbered for m in messages):
        views = [memoryview(message.eager) for message in messages]  # a repeated step
        return {
            name: [view[offset : offset + nbytes] for view in views]
            for name, offset, nbytes in layout(first, cache)
        }
    common: dict[str, list[memoryview]] | None = None
    for message in messages:
        data = memoryview(message.eager)
        here = {name: data[o : o + n] for name, o, n in layout(message, cache)}
        if common is None:
            common = {name: [view] for name, view in here.items()}
        else:
            common = {name: [*views, here[name]] for name, views in common.items() if name in here}
        if not common:
            return {}
    return common or {}


def reduce_copies(
    outs: list[np.ndarray],
    copies: Sequence[bytes | bytearray | memoryview],
    op: ReduceOp,
    code: DType,
    offset: int,
    factor: float,
) -> None:
    """`reduce_into`, then the result times `factor` (an allreduce's, see
    `fusion.result_factor`)."""
    reduce_into(outs, copies, op, code, offset)
    if factor != 1.0:
        for out in outs:
            reduce.scale(out, factor, code)


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
        reduce.combine_into(out, first, np.frombuffer(copies[1], storage, count, offset), op, code)
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
