"""The message exchange of a negotiation cycle: every rank sends every other rank its
`Message` and receives theirs, on the engine's control communicator.

A rank that has something to run starts a cycle by sending; a rank that sees a message
arrive (`peer_started`) joins the cycle. Every wait has the engine's deadline: a peer that
never answers is named (see `waiting.Waiter`).
"""

from __future__ import annotations

import pickle
import struct
from typing import TYPE_CHECKING

from .negotiation import Message
from .waiting import Waiter

if TYPE_CHECKING:
    from mpi4py import MPI

CONTROL_TAG = 7100

# A repeated step's message (cached bits only) goes as a few bytes: a marker, the cycle,
# the joined cycle, the flags, the training phase's seconds and length, the phase, then the
# bit vector; anything else is pickled.
_COMPACT = b"\x00"
_HEADER = struct.Struct("<qqBdH")
_SHUTDOWN, _RENEW = 1, 2


def encode(message: Message) -> bytearray:
    """`message` as bytes for the wire."""
    if message.new or message.stall_abort:
        return bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    flags = (_SHUTDOWN if message.shutdown else 0) | (_RENEW if message.renew else 0)
    phase, seconds = message.activity
    words = phase.encode()
    bits = message.cached
    return bytearray(
        _COMPACT
        + _HEADER.pack(message.cycle, message.joined_cycle, flags, seconds, len(words))
        + words
        + bits.to_bytes((bits.bit_length() + 7) // 8, "little")
    )


def decode(data: bytes | bytearray) -> Message:
    """The message `encode` made (a pickle never starts with a zero byte)."""
    if data[:1] != _COMPACT:
        return pickle.loads(data)
    cycle, joined, flags, seconds, length = _HEADER.unpack_from(data, 1)
    start = 1 + _HEADER.size
    phase = bytes(data[start : start + length]).decode()
    cached = int.from_bytes(data[start + length :], "little")
    return Message(
        cycle,
        cached,
        joined_cycle=joined,
        shutdown=bool(flags & _SHUTDOWN),
        renew=bool(flags & _RENEW),
        activity=(phase, seconds),
    )


class Exchange:
    """Messages among the ranks of one engine (its control communicator)."""

    def __init__(self, comm: MPI.Comm | None, waiter: Waiter, rank: int, size: int) -> None:
        self.comm = comm
        self.waiter = waiter
        self.rank, self.size = rank, size
        self._peers = [(rank + d) % size for d in range(1, size)]

    def peer_started(self) -> bool:
        """Whether a peer's message of a cycle this rank has not run yet has arrived."""
        return self.comm is not None and self.comm.Iprobe(tag=CONTROL_TAG)

    def exchange(self, cycle: int, own: Message, pending: list[str]) -> list[Message]:
        """Send `own` to every peer and receive theirs (this cycle's, in rank order)."""
        messages: list[Message | None] = [None] * self.size
        messages[self.rank] = own
        if self.size == 1:
            return messages  # type: ignore[return-value]
        from mpi4py import MPI

        ctrl = self.comm
        payload = encode(own)
        sends = [ctrl.Isend([payload, MPI.BYTE], peer, CONTROL_TAG) for peer in self._peers]
        waiting = list(self._peers)
        status = MPI.Status()

        def arrived() -> bool:
            for peer in list(waiting):
                if ctrl.Iprobe(source=peer, tag=CONTROL_TAG, status=status):
                    buffer = bytearray(status.Get_count(MPI.BYTE))
                    ctrl.Recv([buffer, MPI.BYTE], peer, CONTROL_TAG)
                    messages[peer] = decode(buffer)
                    waiting.remove(peer)
            return not waiting

        pending = sorted(pending)
        shown = ", ".join(repr(n) for n in pending[:5]) + (", ..." if len(pending) > 5 else "")
        self.waiter.begin(cycle, -1, "negotiation")
        # A rank that sent its message is alive: only the others can be the ones missing.
        self.waiter.wait(
            arrived,
            f"pending here: {shown or 'nothing of its own'}",
            missing=lambda: sorted(waiting),
        )
        self.waiter.wait_requests(sends, "sending this rank's negotiation message")
        return messages  # type: ignore[return-value]
