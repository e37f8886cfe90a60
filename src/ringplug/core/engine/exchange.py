"""The message exchange of a negotiation cycle: every rank gets every other rank's
`Message`, on the engine's control communicator, in ceil(log2 p) rounds (`Exchange`).

A rank that has something to run starts a cycle by sending; a rank that sees a message
arrive (`peer_started`) joins the cycle. Every wait has the engine's deadline: a peer that
never answers is named (see `waiting.Waiter`).
"""

from __future__ import annotations

import functools
import itertools
import pickle
import struct
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from ..transport.traffic import NEGOTIATION
from ..transport.waiting import Waiter
from .negotiation import Message

if TYPE_CHECKING:
    from mpi4py import MPI

CONTROL_TAG = 7100
GATHER_TAG = 7101
# See `gathers_only`.
GATHER_ONLY_UP_TO = 7

# A message without new requests goes as a few bytes: a marker, then its form (the cycle,
# the joined cycle, the flags, the lengths of the bit vector, the numbered list and the
# eager data; the bit vector; the numbered (slot, number) pairs), which is byte for byte
# the same on every rank in a repeated step; then the eager data, and last the training's
# phase (its seconds, length and words), which differs from rank to rank. Anything else is
# pickled. Before eager data the form is padded with zeros to a multiple of 16 bytes, so that
# the data lies aligned in the received buffer: numpy combines misaligned copies 2x slower.
_COMPACT = b"\x00"
_FORM = struct.Struct("<qqBHHI")  # at most 65535 bytes of bits: 4096 slots fit
_PHASE = struct.Struct("<fB")  # a phase is a short phrase: at most 255 bytes are sent
PAIR = struct.Struct("<qq")  # a numbered (slot, number) pair
_CYCLE = struct.Struct("<xq")  # the marker and `_FORM`'s first field (see `message_from`)
_SHUTDOWN, _RENEW = 1, 2
# A mark that two ranks' forms differ (a form starts with a zero byte): see `Exchange.agree`.
_DIFFERENT = b"\x01"
_ALIGN = 16
_PADDING = [bytes(n) for n in range(_ALIGN)]


def _padding(unpadded: int, eager_length: int) -> int:
    """Zero bytes after a form of `unpadded` bytes: only a message with eager data has any."""
    return -unpadded % _ALIGN if eager_length else 0


def encode(message: Message) -> bytes:
    """`message` as bytes for the wire."""
    if message.new or message.stall_abort or message.report or len(message.numbered) > 0xFFFF:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    flags = (_SHUTDOWN if message.shutdown else 0) | (_RENEW if message.renew else 0)
    return compact(
        message.cycle,
        message.cached,
        message.numbered,
        (message.eager,),
        message.activity,
        message.joined_cycle,
        flags,
    )


def compact(
    cycle: int,
    cached: int,
    numbered: Sequence[tuple[int, int]],
    eager: Sequence[bytes | memoryview],
    activity: tuple[str, float],
    joined_cycle: int = 0,
    flags: int = 0,
) -> bytes:
    """The compact form of a message without new requests (see `encode`); `eager` is its
    eager data in pieces (bytes, or memoryviews of bytes)."""
    if not eager:
        size = 0
    elif len(eager) == 1:
        size = len(eager[0])
    else:
        size = sum(len(piece) for piece in eager)
    if not numbered:
        pairs = b""
    elif len(numbered) == 1:
        pairs = PAIR.pack(*numbered[0])
    else:
        pairs = struct.pack(f"<{2 * len(numbered)}q", *itertools.chain.from_iterable(numbered))
    form = form_parts(cached, len(numbered), size, joined_cycle, flags)
    return message_from(cycle, form, pairs, eager, activity)


def form_parts(
    cached: int, count: int, eager_length: int, joined_cycle: int = 0, flags: int = 0
) -> tuple[bytes, bytes, int]:
    """The parts of a compact form that do not change from cycle to cycle, for `count`
    numbered pairs and `eager_length` bytes of data: (the bytes between the cycle and the
    pairs: the form's other fields and the bit vector; the padding after the pairs; the
    length of the whole form). A cycle's fast path keeps them per cache slot and writes
    only its cycle number and its pair each call (`message_from`)."""
    length = (cached.bit_length() + 7) // 8
    # `_FORM` with the cycle left out: its first field, 8 bytes
    middle = _FORM.pack(0, joined_cycle, flags, length, count, eager_length)[8:]
    unpadded = 1 + _FORM.size + length + PAIR.size * count
    padding = _padding(unpadded, eager_length)
    return middle + cached.to_bytes(length, "little"), _PADDING[padding], unpadded + padding


def message_from(
    cycle: int,
    form: tuple[bytes, bytes, int],
    pairs: bytes,
    eager: Sequence[Any],
    activity: tuple[str, float],
) -> bytes:
    """A compact message from its `form_parts`, its cycle, its numbered `pairs` (`PAIR`
    each), its eager data (objects whose buffers are its bytes: a kind's
    `carried_pieces`) and its phase."""
    phase, seconds = activity
    words = phase.encode()[:255]
    return b"".join(
        (
            _CYCLE.pack(cycle),
            form[0],
            pairs,
            form[1],
            *eager,
            _PHASE.pack(seconds, len(words)),
            words,
        )
    )


def form_length(data: bytes | bytearray) -> int:
    """How many leading bytes of an encoded message say what it has ready, with their
    padding (0: pickled)."""
    if data[:1] != _COMPACT:
        return 0
    _, _, _, length, count, eager_length = _FORM.unpack_from(data, 1)
    unpadded = 1 + _FORM.size + length + PAIR.size * count
    return unpadded + _padding(unpadded, eager_length)


def decode(data: bytes | bytearray) -> Message:
    """The message `encode` made (a pickle never starts with a zero byte)."""
    if data[:1] != _COMPACT:
        return pickle.loads(data)
    cycle, joined, flags, length, count, eager_length = _FORM.unpack_from(data, 1)
    start = 1 + _FORM.size
    cached = int.from_bytes(data[start : start + length], "little")
    start += length
    numbered = []
    if count:
        values = struct.unpack_from(f"<{2 * count}q", data, start)
        numbered = list(zip(values[::2], values[1::2], strict=True))
        start += 16 * count
    start += _padding(start, eager_length)
    return Message(
        cycle,
        cached,
        numbered=numbered,
        joined_cycle=joined,
        shutdown=bool(flags & _SHUTDOWN),
        renew=bool(flags & _RENEW),
        activity=_phase(data, start + eager_length),
        # no copy: the received buffer is this message's
        eager=memoryview(data)[start : start + eager_length],
    )


def _phase(data: bytes | bytearray, start: int) -> tuple[str, float]:
    seconds, length = _PHASE.unpack_from(data, start)
    start += _PHASE.size
    return bytes(data[start : start + length]).decode(errors="replace"), seconds


class Exchange:
    """Messages among the ranks of one engine (its control communicator).

    Every rank gets every rank's message in ceil(log2 p) rounds (Bruck's allgather,
    `gather`): in round k a rank sends the messages it holds of itself and the next ranks
    (at most 2^k of them) to rank - 2^k, and receives as many from rank + 2^k. A rank so
    sends ceil(log2 p) messages per cycle, not p - 1, and polls one peer at a time.

    On more ranks than `gathers_only` allows (8 and more), a cycle first finds out, in
    the same rounds, whether every rank's message has the same form (`agree`: each round
    passes on one form, or a mark that two differed): a repeated training step is then
    negotiated, with ceil(log2 p) messages of a few bytes each, and no rank decodes p
    messages. Only when the forms differ are the messages gathered.

    A rank whose engine is idle joins the cycle when any peer's message reaches it
    (`peer_started`); the round-0 messages alone pass the start around every rank.
    """

    def __init__(self, comm: MPI.Comm | None, waiter: Waiter, rank: int, size: int) -> None:
        self.comm = comm
        self.waiter = waiter
        self.rank, self.size = rank, size
        # Per round: (the peer sent to, the peer received from, how many messages each
        # carries).
        self.rounds = rounds(rank, size)
        self.agrees_first = not gathers_only(size)
        self.agreed_cycles = 0  # cycles whose messages all had one form (`agree`)
        if comm is not None:
            from mpi4py import MPI

            self._status = MPI.Status()
            self._byte, self._testall = MPI.BYTE, MPI.Request.Testall
            if size == 2:
                # `_pair`'s test that the peer's message has arrived, and the peer a long wait
                # names, made once: the wait polls MPI's probe without a Python frame of its
                # own, and a cycle makes no functions for it.
                peer = 1 - rank
                self._peer_sent = functools.partial(comm.Iprobe, peer, CONTROL_TAG, self._status)
                self._the_peer = lambda: [peer]

    def peer_started(self) -> bool:
        """Whether a peer's message of a cycle this rank has not run yet has arrived."""
        return self.comm is not None and self.comm.Iprobe(tag=CONTROL_TAG)

    def exchange(
        self, cycle: int, own: Message, pending: Collection[str]
    ) -> tuple[list[Message], bool]:
        """Send `own` to the peers and receive theirs (this cycle's, in rank order);
        `pending` names this rank's requests, for the message of a long wait.

        Also returns whether every peer's message has `own`'s form (see `same_form`).
        """
        wire = encode(own)
        received = self.send_and_receive(cycle, wire, pending)
        length = same_form(wire, received)
        return messages(own, wire, received, length), bool(length)

    def send_and_receive(
        self, cycle: int, wire: bytes, pending: Collection[str]
    ) -> list[bytes | bytearray]:
        """Every rank's encoded message, in rank order (this rank's is `wire`); when every
        message has `wire`'s form and the ranks found that out without gathering them
        (`agree`), `wire` in every place (their eager data and phases stay unknown: only
        a job that `gathers_only` carries eager data)."""
        if self.size == 1:
            return [wire]
        self.waiter.begin(cycle, -1, "negotiation")
        if self.size == 2:
            return self._pair(wire, pending)
        if self.agrees_first and self.agree(wire, pending):
            self.agreed_cycles += 1
            return Alike([wire]) * self.size
        return self.gather(wire, pending)

    def _pair(self, wire: bytes, pending: Collection[str]) -> list[bytes | bytearray]:
        """`gather` on 2 ranks (one round: this rank's message for the peer's), without its
        general machinery: a synchronous call's cycle on 2 ranks costs that much less."""
        ctrl, byte, status, peer_sent = self.comm, self._byte, self._status, self._peer_sent
        peer = 1 - self.rank
        send = ctrl.Isend([wire, byte], peer, CONTROL_TAG)
        self.waiter.traffic.sent(NEGOTIATION, len(wire))
        if not peer_sent():
            self.waiter.wait(peer_sent, lambda: _pending_text(pending), missing=self._the_peer)
        buffer = bytearray(status.Get_count(byte))
        ctrl.Recv([buffer, byte], peer, CONTROL_TAG)
        if not send.Test():
            self.waiter.wait_requests([send], "sending this rank's negotiation message")
        return [wire, buffer] if peer else [buffer, wire]

    def agree(self, wire: bytes, pending: Collection[str]) -> bool:
        """Whether every rank's message has `wire`'s form (a dissemination allreduce of the
        forms: each round combines two into one, or into the mark that they differ, which
        is the same whichever ranks a form stands for, so that no rank counts twice)."""
        size, rank = self.size, self.rank
        length = form_length(wire)
        state = [bytes(wire[:length]) if length else _DIFFERENT]
        covered = [1]  # the ranks from this one up that `state` stands for

        def take(round_: int, buffer: bytearray) -> None:
            if state[0] != buffer:
                state[0] = _DIFFERENT
            covered[0] = min(2 * covered[0], size)

        def missing() -> set[int]:
            return {(rank + i) % size for i in range(covered[0], size)}

        self._rounds(CONTROL_TAG, lambda _: state[0], take, missing, pending)
        return state[0] != _DIFFERENT

    def gather(self, wire: bytes, pending: Collection[str]) -> list[bytes | bytearray]:
        """Every rank's message as it was sent, in rank order (this rank's is `wire`), in
        the rounds of `rounds`."""
        size, rank = self.size, self.rank
        received: list[bytes | bytearray | None] = [None] * size
        received[rank] = wire
        plan = self.rounds

        def payload(round_: int) -> bytes | bytearray:
            count = plan[round_][2]
            return pack([received[(rank + i) % size] for i in range(count)])

        def take(round_: int, buffer: bytearray) -> None:
            _, source, count = plan[round_]
            for i, data in enumerate(unpack(buffer, count)):
                received[(source + i) % size] = data

        def missing() -> set[int]:
            return {r for r in range(size) if received[r] is None}

        # The first round of a cycle that agrees first went on CONTROL_TAG already: the
        # gather has its own tag, so that an idle rank never takes it for a new cycle.
        tag = GATHER_TAG if self.agrees_first else CONTROL_TAG
        self._rounds(tag, payload, take, missing, pending)
        return received  # type: ignore[return-value]

    def _rounds(
        self,
        tag: int,
        payload: Callable[[int], bytes | bytearray],
        take: Callable[[int, bytearray], None],
        missing: Callable[[], set[int]],
        pending: Collection[str],
    ) -> None:
        """Run the rounds of `rounds`: send `payload(k)` in round k, once round k - 1's
        message is `take`n; every wait with the engine's deadline, naming the ranks
        `missing()` says were not heard from, and the peer waited for."""
        ctrl, byte, status = self.comm, self._byte, self._status
        probe, traffic = ctrl.Iprobe, self.waiter.traffic
        plan = self.rounds
        sends = []
        payloads = []  # alive until their sends complete
        at = [0]  # the round this rank waits in

        def post(round_: int) -> None:
            data = payload(round_)
            payloads.append(data)
            sends.append(ctrl.Isend([data, byte], plan[round_][0], tag))
            traffic.sent(NEGOTIATION, len(data))

        def arrived() -> bool:
            while at[0] < len(plan):
                source = plan[at[0]][1]
                if not probe(source, tag, status):
                    return False
                buffer = bytearray(status.Get_count(byte))
                ctrl.Recv([buffer, byte], source, tag)
                take(at[0], buffer)
                at[0] += 1
                if at[0] < len(plan):
                    post(at[0])
            return True

        def lacking() -> list[int]:
            # A rank frozen after its own message went on still holds up the others': the
            # peer this rank waits for now is named too.
            found = missing()
            if at[0] < len(plan):
                found.add(plan[at[0]][1])
            return sorted(found)

        post(0)
        if not arrived():
            self.waiter.wait(arrived, lambda: _pending_text(pending), missing=lacking)
        if not self._testall(sends):
            self.waiter.wait_requests(sends, "sending this rank's negotiation messages")


def gathers_only(size: int) -> bool:
    """Whether a job of `size` ranks gathers every cycle's messages without agreeing on
    their form first (see `Exchange`), and may carry small allreduces' data in them: up to
    `GATHER_ONLY_UP_TO` ranks.

    Gathered messages cost each rank p - 1 forms, and with carried data (p - 1) n bytes for
    n bytes of data where recursive doubling sends n ceil(log2 p): up to 7 ranks that is at
    most twice as much (p - 1 <= 2 ceil(log2 p)), and a repeated step needs one pass
    instead of two.
    """
    return size <= GATHER_ONLY_UP_TO


def rounds(rank: int, size: int) -> list[tuple[int, int, int]]:
    """The rounds of `Exchange.send_and_receive` on `rank` of `size` ranks: (the peer sent
    to, the peer received from, how many ranks' messages each round's message carries)."""
    plan = []
    distance = 1
    while distance < size:
        plan.append(
            ((rank - distance) % size, (rank + distance) % size, min(distance, size - distance))
        )
        distance *= 2
    return plan


_LENGTH = struct.Struct("<I")


def pack(blocks: Sequence[bytes | bytearray]) -> bytes | bytearray:
    """One round's message: one rank's message as it is, or several, each after its length."""
    if len(blocks) == 1:
        return blocks[0]
    lengths = struct.pack(f"<{len(blocks)}I", *(len(block) for block in blocks))
    return b"".join((lengths, *blocks))


def unpack(buffer: bytearray, count: int) -> list[bytearray]:
    """The `count` ranks' messages of a round's message (see `pack`)."""
    if count == 1:
        return [buffer]
    lengths = struct.unpack_from(f"<{count}I", buffer)
    start = _LENGTH.size * count
    found = []
    for length in lengths:
        found.append(buffer[start : start + length])
        start += length
    return found


class Alike(list):
    """`wire` in every rank's place: what `Exchange.send_and_receive` returns when the ranks
    agreed that every message has its form (`same_form` and `messages` then need not look
    at p of them)."""

    def __mul__(self, count: int) -> Alike:  # type: ignore[override]
        return Alike(list.__mul__(self, count))


def same_form(wire: bytes, received: Sequence[bytes | bytearray], length: int = -1) -> int:
    """The length of the form (see `encode`) that every message in `received` shares with
    this rank's `wire`, or 0 when one differs or `wire` is pickled: a repeated step on every
    rank, with the same requests ready everywhere and no news. `length`: the form's length
    where the caller knows it (`form_parts`)."""
    if length < 0:
        length = form_length(wire)
    if length and not isinstance(received, Alike):
        form = wire[:length]
        for data in received:
            if data is not wire and not data.startswith(form):
                return 0
    return length


def messages(
    own: Message, wire: bytes, received: Sequence[bytes | bytearray], length: int
) -> list[Message]:
    """Every rank's message from what `send_and_receive` returned; `length` is the form
    they all share with `own` (`same_form`; 0: none), and then the peers' messages are
    `own`'s with their own eager data and phase, without decoding the rest."""
    if isinstance(received, Alike):
        return [own] * len(received)
    if length:
        return [own if d is wire else _alike(own, d, length) for d in received]
    return [own if d is wire else decode(d) for d in received]


def _alike(own: Message, data: bytes | bytearray, start: int) -> Message:
    """A peer's message whose form is `own`'s: `own` with the peer's eager data and phase."""
    end = start + len(own.eager)
    return Message(
        own.cycle,
        own.cached,
        numbered=own.numbered,
        joined_cycle=own.joined_cycle,
        shutdown=own.shutdown,
        renew=own.renew,
        activity=_phase(data, end),
        eager=memoryview(data)[start:end],
    )


def _pending_text(pending: Collection[str]) -> str:
    names = sorted(pending)
    shown = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
    return f"pending here: {shown or 'nothing of its own'}"
