"""The message exchange of a negotiation cycle: every rank sends every other rank its
`Message` and receives theirs, on the engine's control communicator.

A rank that has something to run starts a cycle by sending; a rank that sees a message
arrive (`peer_started`) joins the cycle. Every wait has the engine's deadline: a peer that
never answers is named (see `waiting.Waiter`).
"""

from __future__ import annotations

import itertools
import pickle
import struct
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from ..transport.waiting import Waiter
from .negotiation import Message

if TYPE_CHECKING:
    from mpi4py import MPI

CONTROL_TAG = 7100

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
_PAIR = struct.Struct("<qq")
_SHUTDOWN, _RENEW = 1, 2
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
    phase, seconds = activity
    words = phase.encode()[:255]
    length = (cached.bit_length() + 7) // 8
    size = sum(len(piece) for piece in eager) if len(eager) != 1 else len(eager[0])
    form = _FORM.pack(cycle, joined_cycle, flags, length, len(numbered), size)
    if not numbered:
        pairs = b""
    elif len(numbered) == 1:
        pairs = _PAIR.pack(*numbered[0])
    else:
        pairs = struct.pack(f"<{2 * len(numbered)}q", *itertools.chain.from_iterable(numbered))
    return b"".join(
        (
            _COMPACT,
            form,
            cached.to_bytes(length, "little"),
            pairs,
            _PADDING[_padding(1 + _FORM.size + length + len(pairs), size)],
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
    unpadded = 1 + _FORM.size + length + 16 * count
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
    """Messages among the ranks of one engine (its control communicator)."""

    def __init__(self, comm: MPI.Comm | None, waiter: Waiter, rank: int, size: int) -> None:
        self.comm = comm
        self.waiter = waiter
        self.rank, self.size = rank, size
        self._peers = [(rank + d) % size for d in range(1, size)]
        if comm is not None:
            from mpi4py import MPI

            self._status = MPI.Status()
            self._byte, self._testall = MPI.BYTE, MPI.Request.Testall

    def peer_started(self) -> bool:
        """Whether a peer's message of a cycle this rank has not run yet has arrived."""
        return self.comm is not None and self.comm.Iprobe(tag=CONTROL_TAG)

    def exchange(
        self, cycle: int, own: Message, pending: Collection[str]
    ) -> tuple[list[Message], bool]:
        """Send `own` to every peer and receive theirs (this cycle's, in rank order);
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
        """Send this rank's encoded message to every peer and receive theirs: every rank's
        message as it came, in rank order (this rank's is `wire`)."""
        received: list[bytes | bytearray | None] = [None] * self.size
        received[self.rank] = wire
        if self.size == 1:
            return received  # type: ignore[return-value]
        ctrl, byte = self.comm, self._byte
        payload = [wire, byte]
        sends = [ctrl.Isend(payload, peer, CONTROL_TAG) for peer in self._peers]
        waiting = list(self._peers)
        status = self._status
        probe = ctrl.Iprobe

        def arrived() -> bool:
            for peer in waiting:
                if probe(peer, CONTROL_TAG, status):
                    buffer = bytearray(status.Get_count(byte))
                    ctrl.Recv([buffer, byte], peer, CONTROL_TAG)
                    received[peer] = buffer
            if len(waiting) > 1:
                waiting[:] = [peer for peer in waiting if received[peer] is None]
            elif received[waiting[0]] is not None:
                waiting.clear()
            return not waiting

        self.waiter.begin(cycle, -1, "negotiation")
        if not arrived():
            # A rank that sent its message is alive: only the others can be the ones missing.
            self.waiter.wait(
                arrived, lambda: _pending_text(pending), missing=lambda: sorted(waiting)
            )
        if not self._testall(sends):
            self.waiter.wait_requests(sends, "sending this rank's negotiation message")
        return received  # type: ignore[return-value]


def same_form(wire: bytes, received: Sequence[bytes | bytearray]) -> int:
    """The length of the form (see `encode`) that every message in `received` shares with
    this rank's `wire`, or 0 when one differs or `wire` is pickled: a repeated step on every
    rank, with the same requests ready everywhere and no news."""
    length = form_length(wire)
    if length:
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
