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
from collections.abc import Collection
from typing import TYPE_CHECKING

from .negotiation import Message
from .waiting import Waiter

if TYPE_CHECKING:
    from mpi4py import MPI

CONTROL_TAG = 7100

# A repeated step's message (cached and numbered requests only) goes as a few bytes: a
# marker, the cycle, the joined cycle, the flags, the training phase's seconds, the lengths
# of the phase, the bit vector and the numbered list, then the phase, the bit vector, the
# numbered (slot, number) pairs and the eager data; anything else is pickled.
_COMPACT = b"\x00"
_HEADER = struct.Struct("<qqBfHHH")  # at most 65535 bytes of bits: 4096 slots fit
_SHUTDOWN, _RENEW = 1, 2


def encode(message: Message) -> bytes:
    """`message` as bytes for the wire."""
    if message.new or message.stall_abort or len(message.numbered) > 0xFFFF:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    flags = (_SHUTDOWN if message.shutdown else 0) | (_RENEW if message.renew else 0)
    phase, seconds = message.activity
    words = phase.encode()
    bits = message.cached
    length = (bits.bit_length() + 7) // 8
    numbered = message.numbered
    header = _HEADER.pack(
        message.cycle, message.joined_cycle, flags, seconds, len(words), length, len(numbered)
    )
    pairs = (
        struct.pack(f"<{2 * len(numbered)}q", *itertools.chain.from_iterable(numbered))
        if numbered
        else b""
    )
    return b"".join(
        (_COMPACT, header, words, bits.to_bytes(length, "little"), pairs, message.eager)
    )


def decode(data: bytes | bytearray) -> Message:
    """The message `encode` made (a pickle never starts with a zero byte)."""
    if data[:1] != _COMPACT:
        return pickle.loads(data)
    cycle, joined, flags, seconds, length, bits_length, count = _HEADER.unpack_from(data, 1)
    start = 1 + _HEADER.size
    phase = data[start : start + length].decode()
    start += length
    cached = int.from_bytes(data[start : start + bits_length], "little")
    start += bits_length
    numbered = []
    if count:
        values = struct.unpack_from(f"<{2 * count}q", data, start)
        numbered = list(zip(values[::2], values[1::2], strict=True))
        start += 16 * count
    return Message(
        cycle,
        cached,
        numbered=numbered,
        joined_cycle=joined,
        shutdown=bool(flags & _SHUTDOWN),
        renew=bool(flags & _RENEW),
        activity=(phase, seconds),
        eager=memoryview(data)[start:],  # no copy: the received buffer is this message's
    )


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

    def exchange(self, cycle: int, own: Message, pending: Collection[str]) -> list[Message]:
        """Send `own` to every peer and receive theirs (this cycle's, in rank order);
        `pending` names this rank's requests, for the message of a long wait."""
        messages: list[Message | None] = [None] * self.size
        messages[self.rank] = own
        if self.size == 1:
            return messages  # type: ignore[return-value]
        ctrl, byte = self.comm, self._byte
        payload = [encode(own), byte]
        sends = [ctrl.Isend(payload, peer, CONTROL_TAG) for peer in self._peers]
        waiting = list(self._peers)
        status = self._status
        probe = ctrl.Iprobe

        def arrived() -> bool:
            for peer in waiting:
                if probe(peer, CONTROL_TAG, status):
                    buffer = bytearray(status.Get_count(byte))
                    ctrl.Recv([buffer, byte], peer, CONTROL_TAG)
                    messages[peer] = decode(buffer)
            if len(waiting) > 1:
                waiting[:] = [peer for peer in waiting if messages[peer] is None]
            elif messages[waiting[0]] is not None:
                waiting.clear()
            return not waiting

        self.waiter.begin(cycle, -1, "negotiation")
        if not arrived():
            pending = sorted(pending)
            shown = ", ".join(repr(n) for n in pending[:5]) + (", ..." if len(pending) > 5 else "")
            # A rank that sent its message is alive: only the others can be the ones missing.
            self.waiter.wait(
                arrived,
                f"pending here: {shown or 'nothing of its own'}",
                missing=lambda: sorted(waiting),
            )
        if not self._testall(sends):
            self.waiter.wait_requests(sends, "sending this rank's negotiation message")
        return messages  # type: ignore[return-value]
