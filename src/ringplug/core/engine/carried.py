"""Data that travels inside the negotiation message ("eager" data), whatever its kind.

A rank that has a small request ready, of a name the ranks agreed on before (it has a cache
slot), appends its data to the cycle's message (what and how much: its kind's
`carried_bytes` and `carried_pieces`; today small host allreduces). When every rank's
message of a cycle carries the data of a request, each rank completes it from the copies
itself (its kind's `run_carried`): the request costs no collective of its own. Otherwise (a
rank sent the request as new, a rank has joined, the budget was spent before it) it takes
the usual path.

Which requests a message carries follows from its cached bits, its numbered requests and
the cache alone, so that every rank reads every message the same way: the eligible slots
(`Cache.eager_mask`) in slot order, then the eligible numbered requests in the message's
order, while their bytes fit in `RINGPLUG_EAGER_THRESHOLD` in all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..kinds.kind import kind_of

if TYPE_CHECKING:
    from ...wire import Message
    from .handles import Request
    from .negotiation import Cache


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
    """This rank's carried data for its `message` (`pending`: its requests by name)."""
    pieces = []
    for name, _, _ in layout(message, cache):
        request = pending[name]
        pieces += kind_of(request.signature.kind).carried_pieces(request)
    return b"".join(pieces)


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
