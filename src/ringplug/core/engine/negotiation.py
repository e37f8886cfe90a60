"""How ranks agree on what to run: a pure function from every rank's message to one plan.

Each engine cycle, every rank gets every other rank's message (in ceil(log2 p) rounds,
see `exchange`): the requests it has ready. Requests the ranks have agreed on before are
named by their slot in a cache that is identical on every rank, so a training step whose
tensors repeat costs a bit vector per cycle, with no coordinator and no per-tensor round
trip. Requests named by their place in call order ("noname.12", "torch.default#7"), new
names each time, go as their number and the slot of their prefix and signature once the
ranks have agreed on one of that form. New requests carry their name and signature (kind,
dtype, op, root, shape).

Every rank runs `decide` on the same messages and gets the same plan: which requests run,
in which order (the order of the lowest-ranked active rank), which fail because their
signatures differ, which are still missing on some ranks (the stall inspector's input),
and whether the job is shutting down or everyone has joined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ...wire import Kind, Message, Response, Signature, numbered
from ..kinds.kind import kind_of

__all__ = ["Cache", "Plan", "decide"]


@dataclasses.dataclass(slots=True)
class Plan:
    responses: list[Response] = dataclasses.field(default_factory=list)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> message
    # name -> ranks that have it ready; only names some active ranks still lack.
    partial: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    shutdown_by: int | None = None
    all_joined: bool = False
    last_joined: int = -1
    stall_abort: list[str] = dataclasses.field(default_factory=list)
    # Every rank has the same requests of the cache ready, and nothing else.
    repeated: bool = False
    # Only requests of the cache (repeated or not): the cache has nothing to learn.
    nothing_new: bool = False


# How many forms of a repeated step `Cache.repeated` keeps (a training loop has a few: the
# step's cycles, a metric sync, the epoch's end).
_REPEATED_KEPT = 16


class Cache:
    """Names agreed before, by slot; updated identically on every rank after each plan."""

    def __init__(self, capacity: int, eager_threshold: int = 0) -> None:
        self.capacity = capacity
        self.slots: list[tuple[str, Signature]] = []  # (name or numbered prefix, signature)
        self.by_name: dict[str, int] = {}
        self.by_prefix: dict[tuple[str, Signature], int] = {}  # numbered names' slots
        # The slots whose requests messages may carry with their data (see `carried`), and
        # their bytes.
        self.eager_threshold = eager_threshold
        self.eager_mask = 0
        self.eager_bytes: list[int] = []
        # carried.layout's last answer: (cached bits, numbered pairs, layout).
        self.last_layout: tuple[int, list[tuple[int, int]], list[tuple[str, int, int]]] | None = (
            None
        )
        # `repeated`'s recent answers: (cached bits, ranks) -> responses.
        self._repeated: dict[tuple[int, int], list[Response]] = {}

    def slot_for(self, name: str, signature: Signature) -> int | None:
        """The slot that names this request exactly, or None (send it as new)."""
        slot = self.by_name.get(name)
        if slot is not None and self.slots[slot][1] == signature:
            return slot
        return None

    def form_for(
        self, name: str, cacheable: bool, signature: Signature
    ) -> tuple[int, int, tuple[tuple[int, int], ...]] | None:
        """(slot, cached bits, numbered pairs) with which a message names this request
        alone, or None when the ranks have not agreed on it (send it as new)."""
        if cacheable:
            slot = self.slot_for(name, signature)
            return None if slot is None else (slot, 1 << slot, ())
        entry = self.numbered_slot(name, signature)
        return None if entry is None else (entry[0], 0, (entry,))

    def numbered_slot(self, name: str, signature: Signature) -> tuple[int, int] | None:
        """(slot, number) for a request numbered in call order whose prefix and signature
        the ranks agreed on before, or None (send it as new)."""
        parts = numbered(name)
        if parts is None:
            return None
        slot = self.by_prefix.get((parts[0], signature))
        return None if slot is None else (slot, parts[1])

    def repeated(self, message: Message, ranks: int) -> list[Response]:
        """The responses of a repeated step in which every one of `ranks` ranks has the
        requests `message` names ready, alike: an earlier step's own list when it named the
        same slots alone (a training step names the same ones every time, and making a
        thousand responses anew cost a microsecond each). The list and its responses are
        shared by the plans that run them, so nothing may change them."""
        key = (message.cached, ranks)
        if not message.numbered:
            known = self._repeated.get(key)
            if known is not None:
                return known
        responses = [
            Response.everywhere(name, signature, ranks)
            for name, signature in _cached(message, self)
        ]
        if len(responses) > 1 and not message.numbered:
            if len(self._repeated) >= _REPEATED_KEPT:
                self._repeated.clear()
            self._repeated[key] = responses
        return responses

    def learn(self, plan: Plan, cacheable_names: set[str]) -> None:
        """Give agreed, cacheable requests a slot (or their new signature), and the prefix
        and signature of numbered ones (decided from the plan alone, the same everywhere)."""
        self.last_layout = None
        for response in plan.responses:
            name, signature = response.name, response.signature
            if not kind_of(signature.kind).cacheable:
                continue
            if name in cacheable_names:
                slot = self.by_name.get(name)
                if slot is not None:
                    if self.slots[slot][1] == signature:
                        continue  # known as it is: nothing to learn
                    self.slots[slot] = (name, signature)
                    self._repeated.clear()  # steps with this slot run it in its new form
                elif len(self.slots) < self.capacity:
                    slot = self.by_name[name] = self._add(name, signature)
                else:
                    continue
            else:
                parts = numbered(name)
                if parts is None or len(self.slots) >= self.capacity:
                    continue
                key = (parts[0], signature)
                if key in self.by_prefix:
                    continue
                slot = self.by_prefix[key] = self._add(parts[0], signature)
            nbytes = kind_of(signature.kind).carried_bytes(signature, self.eager_threshold)
            self.eager_bytes[slot] = nbytes
            if nbytes:
                self.eager_mask |= 1 << slot
            else:
                self.eager_mask &= ~(1 << slot)

    def _add(self, key: str, signature: Signature) -> int:
        self.slots.append((key, signature))
        self.eager_bytes.append(0)
        return len(self.slots) - 1


def decide(
    messages: Sequence[Message],
    cache: Cache,
    alike: bool = False,
    ranks: Sequence[int] | None = None,
) -> Plan:
    """The plan for one cycle; every rank computes the same one from the same messages
    (`alike`: the exchange found every message of the same form, see `Exchange.exchange`;
    `ranks`: the world's ranks of a process set's members, which its errors name)."""
    first = messages[0]
    if (alike and not (first.new or first.joined_cycle or first.shutdown)) or all(
        m.cached == first.cached
        and m.numbered == first.numbered
        and not (m.new or m.joined_cycle or m.shutdown)
        for m in messages
    ):
        # A repeated step: every rank has the same cached requests ready, and nothing else.
        return Plan(
            cache.repeated(first, len(messages)),
            stall_abort=list(first.stall_abort),
            repeated=True,
            nothing_new=True,
        )
    if not any(m.new or m.numbered or m.joined_cycle or m.shutdown for m in messages):
        return _decide_cached(messages, cache)
    plan = Plan()
    for rank, message in enumerate(messages):
        if message.shutdown:
            plan.shutdown_by = rank
            return plan
    plan.stall_abort = list(messages[0].stall_abort)
    active = [rank for rank, message in enumerate(messages) if not message.joined_cycle]
    ready = [_items(message, cache) for message in messages]
    if not active:
        plan.all_joined = True
        plan.last_joined = max(range(len(messages)), key=lambda r: (messages[r].joined_cycle, r))
        return plan
    leader = active[0]
    seen: set[str] = set()
    for rank in active:
        for name in ready[rank]:
            if name in seen:
                continue
            seen.add(name)
            holders = [r for r in range(len(messages)) if name in ready[r]]
            if any(name not in ready[r] for r in active):
                plan.partial[name] = holders
    for name, (signature, _) in ready[leader].items():
        if name in plan.partial:
            continue
        signatures = {r: ready[r][name][0] for r in range(len(messages)) if name in ready[r]}
        if len(set(signatures.values())) > 1:
            plan.errors[name] = mismatch_message(name, signatures, ranks)
            continue
        plan.responses.append(
            Response(
                name,
                signature,
                extras=[ready[r][name][1] if name in ready[r] else 0 for r in range(len(messages))],
                have=[name in ready[r] for r in range(len(messages))],
            )
        )
    return plan


def _decide_cached(messages: Sequence[Message], cache: Cache) -> Plan:
    """`decide` for messages that name their requests by cache slot alone, not the same
    slots on every rank (ranks part-way through submitting a burst of tensors): the slots
    every rank has ready run, the others wait. A slot stands for one name and signature on
    every rank, so the bits alone decide, without a mismatch to look for."""
    first = messages[0]
    common = union = first.cached
    for message in messages[1:]:
        common &= message.cached
        union |= message.cached
    count = len(messages)
    plan = Plan(stall_abort=list(first.stall_abort), nothing_new=True)
    for name, signature in _in_slots(common, cache):
        plan.responses.append(Response.everywhere(name, signature, count))
    bits = union & ~common
    while bits:
        lowest = bits & -bits
        bits ^= lowest
        plan.partial[cache.slots[lowest.bit_length() - 1][0]] = [
            rank for rank, message in enumerate(messages) if message.cached & lowest
        ]
    return plan


def _in_slots(bits: int, cache: Cache) -> list[tuple[str, Signature]]:
    """(name, signature) of the cache slots whose bits are set, in slot order."""
    found = []
    while bits:
        lowest = bits & -bits
        bits ^= lowest
        found.append(cache.slots[lowest.bit_length() - 1])
    return found


def _cached(message: Message, cache: Cache) -> list[tuple[str, Signature]]:
    """(name, signature) of the requests a message names by cache slot, in its order."""
    found = _in_slots(message.cached, cache)
    for slot, number in message.numbered:
        prefix, signature = cache.slots[slot]
        found.append((f"{prefix}{number}", signature))
    return found


def _items(message: Message, cache: Cache) -> dict[str, tuple[Signature, int]]:
    """name -> (signature, extra) for everything a rank has ready, in its order."""
    items: dict[str, tuple[Signature, int]] = {
        name: (signature, 0) for name, signature in _cached(message, cache)
    }
    for name, signature, extra in message.new:
        items[name] = (signature, extra)
    return items


def mismatch_message(
    name: str, signatures: dict[int, Signature], ranks: Sequence[int] | None = None
) -> str:
    """Say which ranks submitted what under one name, and what to do about it (`ranks`: the
    world's rank of each member of a process set, as the ranks are named)."""
    if ranks is not None:
        signatures = {ranks[r]: s for r, s in signatures.items()}
    if any(s.kind is Kind.ERROR for s in signatures.values()):
        culprits = ", ".join(str(r) for r, s in signatures.items() if s.kind is Kind.ERROR)
        return (
            f"{name!r}: rank(s) {culprits} rejected their arguments (their own error says "
            "why); no rank ran it."
        )
    groups: dict[str, list[int]] = {}
    for rank, signature in sorted(signatures.items()):
        groups.setdefault(kind_of(signature.kind).describe(signature), []).append(rank)
    lines = [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} submitted {text}"
        for text, ranks in groups.items()
    ]
    kinds = {s.kind for s in signatures.values()}
    hint = (
        "allgather and alltoall let the first dimension differ, but not the others or the dtype. "
        if kinds & {Kind.ALLGATHER, Kind.ALLTOALL}
        else ""
    )
    return (
        f"{name!r} does not match across ranks: "
        + "; ".join(lines)
        + ". "
        + hint
        + "Every rank must submit the same collectives under the same names with the same "
        "shapes, dtypes, ops and root ranks; check that every rank builds the same model "
        "and reads the same config."
    )
