"""How ranks agree on what to run: a pure function from every rank's message to one plan.

Each engine cycle, every rank sends every other rank one message: the requests it has
ready. Requests the ranks have agreed on before are named by their slot in a cache that
is identical on every rank, so a training step whose tensors repeat costs a bit vector
per cycle, with no coordinator and no per-tensor round trip. New requests carry their
name and signature (kind, dtype, op, root, shape).

Every rank runs `decide` on the same messages and gets the same plan: which requests run,
in which order (the order of the lowest-ranked active rank), which fail because their
signatures differ, which are still missing on some ranks (the stall inspector's input),
and whether the job is shutting down or everyone has joined.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import NamedTuple

from .kind import GPU, HOST, kind_of


class Kind(enum.IntEnum):
    """The collectives the engine runs (ERROR: a rank rejected its own arguments)."""

    ERROR = 0
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    REDUCESCATTER = 4
    ALLTOALL = 5
    BARRIER = 6
    BROADCAST_OBJECT = 7
    ALLGATHER_OBJECT = 8

    @property
    def label(self) -> str:
        return self.name.lower()


__all__ = ["GPU", "HOST", "Cache", "Kind", "Message", "Plan", "Response", "Signature", "decide"]


class Signature(NamedTuple):
    """What must be equal on every rank for a request to run. For allgather and alltoall
    `shape` holds the dimensions after the first, which may differ between ranks. A grouped
    allreduce has `shape` (total elements,) and the shape of each of its tensors in `parts`.
    `place` is HOST or GPU: ranks must agree on it too. (A tuple: built for every request,
    so it must be cheap.)"""

    kind: Kind
    code: int = -1
    op: int = -1
    root: int = -1
    shape: tuple[int, ...] = ()
    parts: tuple[tuple[int, ...], ...] = ()
    place: int = HOST
    # Fail on every rank when a rank has joined, instead of running without its share
    # (Horovod's semantics for allgather and broadcast; ringplug's own callers leave it off).
    refuse_joined: bool = False

    def describe(self) -> str:
        """The request in words, for mismatch errors (its kind's `describe`)."""
        return kind_of(self.kind).describe(self)


@dataclasses.dataclass
class Message:
    """One rank's contribution to a cycle."""

    cycle: int
    cached: int = 0  # bit s set: the request in cache slot s is ready here
    new: list[tuple[str, Signature, int]] = dataclasses.field(default_factory=list)
    # `new` entries: (name, signature, extra); extra is the first dimension of an
    # allgather/alltoall or the byte length of an object, else 0.
    joined_cycle: int = 0  # > 0: the cycle in which this rank joined
    shutdown: bool = False
    stall_abort: list[str] = dataclasses.field(default_factory=list)  # rank 0's verdict
    renew: bool = False  # a collective was abandoned here: every rank renews its communicator
    activity: tuple[str, float] = ("", 0.0)  # the training's phase, seconds in it (activity.py)


@dataclasses.dataclass
class Response:
    """A request every active rank has ready, with matching signatures: run it."""

    name: str
    signature: Signature
    extras: list[int]  # per rank (0 for joined ranks that do not have the request)
    have: list[bool]  # per rank: whether that rank submitted it (joined ranks may not)


@dataclasses.dataclass
class Plan:
    responses: list[Response] = dataclasses.field(default_factory=list)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> message
    # name -> ranks that have it ready; only names some active ranks still lack.
    partial: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    shutdown_by: int | None = None
    all_joined: bool = False
    last_joined: int = -1
    stall_abort: list[str] = dataclasses.field(default_factory=list)


class Cache:
    """Names agreed before, by slot; updated identically on every rank after each plan."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots: list[tuple[str, Signature]] = []
        self.by_name: dict[str, int] = {}

    def slot_for(self, name: str, signature: Signature) -> int | None:
        """The slot that names this request exactly, or None (send it as new)."""
        slot = self.by_name.get(name)
        if slot is not None and self.slots[slot][1] == signature:
            return slot
        return None

    def learn(self, plan: Plan, cacheable_names: set[str]) -> None:
        """Give agreed, cacheable requests a slot (or their new signature)."""
        for response in plan.responses:
            name = response.name
            if not kind_of(response.signature.kind).cacheable or name not in cacheable_names:
                continue
            slot = self.by_name.get(name)
            if slot is not None:
                self.slots[slot] = (name, response.signature)
            elif len(self.slots) < self.capacity:
                self.by_name[name] = len(self.slots)
                self.slots.append((name, response.signature))


def decide(messages: Sequence[Message], cache: Cache) -> Plan:
    """The plan for one cycle; every rank computes the same one from the same messages."""
    first = messages[0]
    if all(
        m.cached == first.cached and not (m.new or m.joined_cycle or m.shutdown) for m in messages
    ):
        # A repeated step: every rank has the same cached requests ready, and nothing else.
        plan = Plan(stall_abort=list(first.stall_abort))
        count = len(messages)
        bits, slot = first.cached, 0
        while bits:
            if bits & 1:
                name, signature = cache.slots[slot]
                plan.responses.append(Response(name, signature, [0] * count, [True] * count))
            bits >>= 1
            slot += 1
        return plan
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
            plan.errors[name] = mismatch_message(name, signatures)
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


def _items(message: Message, cache: Cache) -> dict[str, tuple[Signature, int]]:
    """name -> (signature, extra) for everything a rank has ready, in its order."""
    items: dict[str, tuple[Signature, int]] = {}
    bits, slot = message.cached, 0
    while bits:
        if bits & 1:
            name, signature = cache.slots[slot]
            items[name] = (signature, 0)
        bits >>= 1
        slot += 1
    for name, signature, extra in message.new:
        items[name] = (signature, extra)
    return items


def mismatch_message(name: str, signatures: dict[int, Signature]) -> str:
    """Say which ranks submitted what under one name, and what to do about it."""
    if any(s.kind is Kind.ERROR for s in signatures.values()):
        culprits = ", ".join(str(r) for r, s in signatures.items() if s.kind is Kind.ERROR)
        return (
            f"{name!r}: rank(s) {culprits} rejected their arguments (their own error says "
            "why); no rank ran it."
        )
    groups: dict[str, list[int]] = {}
    for rank, signature in sorted(signatures.items()):
        groups.setdefault(signature.describe(), []).append(rank)
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
