"""The negotiation message on the wire: compact for a repeated step, pickled otherwise."""

from __future__ import annotations

import pytest

from ringplug.core.exchange import decode, encode
from ringplug.core.negotiation import Kind, Message, Signature

MESSAGES = [
    Message(1),
    Message(7, cached=0b1011),
    Message(2**40, cached=(1 << 4095) | 1, joined_cycle=3),
    Message(9, shutdown=True, renew=True),
    Message(4, cached=2, new=[("w", Signature(Kind.ALLREDUCE, 2, 1, -1, (3, 4)), 0)]),
    Message(5, stall_abort=["grad"]),
    Message(6, cached=1, activity=("waiting for data", 12.5)),
    Message(8, cached=0b110, eager=bytes(range(256)) * 3),
    Message(11, cached=0b1, numbered=[(3, 17), (0, 2**40)], eager=b"\x05" * 8),
    Message(10, cached=1, new=[("x", Signature(Kind.BARRIER), 0)], eager=b"\x01\x02"),
]


@pytest.mark.parametrize("message", MESSAGES)
def test_a_message_comes_back_as_it_was_sent(message):
    assert decode(encode(message)) == message


def test_a_repeated_steps_message_is_a_few_bytes_and_others_are_pickled():
    assert len(encode(Message(123, cached=0b111))) <= 32
    assert encode(MESSAGES[4])[:1] != b"\x00"
