"""The negotiation message on the wire: compact for a repeated step, pickled otherwise."""

from __future__ import annotations

import pytest

from ringplug.core.engine.exchange import (
    PAIR,
    decode,
    encode,
    form_length,
    form_parts,
    message_from,
    messages,
    same_form,
)
from ringplug.wire import Kind, Message, Signature

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


@pytest.mark.parametrize("cached", [0b1, (1 << 4095) | 1, 0b110])
@pytest.mark.parametrize("numbered", [[], [(3, 17)], [(3, 17), (0, 2**40)]])
def test_eager_data_starts_16_byte_aligned_after_the_form(cached, numbered):
    eager = bytes(range(48))
    wire = encode(Message(3, cached=cached, numbered=numbered, eager=eager))
    start = form_length(wire)
    assert start % 16 == 0  # the received buffer's copy is combined by numpy's aligned loops
    assert wire[start : start + len(eager)] == eager


@pytest.mark.parametrize("slot", [0, 5, 63, 4095])
@pytest.mark.parametrize("numbered", [False, True])
@pytest.mark.parametrize("eager", [b"", bytes(range(40)), bytes(4096)])
@pytest.mark.parametrize("activity", [("", 0.25), ("in forward/backward at step 3", 7.5)])
def test_a_lone_requests_message_is_the_message_that_names_it(slot, numbered, eager, activity):
    # The fast path writes the constant parts of a lone request's form once (`form_parts`);
    # what it sends must be the general encoding of the same message, byte for byte: a
    # peer that is not alone decodes it, and compares its form with its own.
    number = 2**33 + slot if numbered else 0
    message = Message(
        77,
        cached=0 if numbered else 1 << slot,
        numbered=[(slot, number)] if numbered else [],
        eager=eager,
        activity=activity,
    )
    form = form_parts(message.cached, 1 if numbered else 0, len(eager))
    pair = PAIR.pack(slot, number) if numbered else b""
    wire = message_from(77, form, pair, [memoryview(eager)] if eager else [], activity)
    assert wire == encode(message)
    assert form[2] == form_length(wire)
    assert decode(wire) == message


def test_a_peer_with_the_same_requests_has_the_same_form_whatever_its_data_and_phase():
    own = Message(5, cached=0b101, numbered=[(2, 9)], eager=b"\x01" * 16)
    peer = Message(
        5, cached=0b101, numbered=[(2, 9)], eager=b"\x07" * 16, activity=("waiting for data", 3.0)
    )
    wire = encode(own)
    received = [wire, bytearray(encode(peer))]
    length = same_form(wire, received)
    assert length > 0
    found = messages(own, wire, received, length)
    # Recognised without decoding, yet exactly what decoding gives.
    assert found[0] is own and found[1] == decode(received[1])


@pytest.mark.parametrize(
    "peer",
    [
        Message(5, cached=0b100, numbered=[(2, 9)], eager=b"\x07" * 16),  # other slots
        Message(5, cached=0b101, numbered=[(2, 10)], eager=b"\x07" * 16),  # other number
        Message(5, cached=0b101, numbered=[(2, 9)], eager=b"\x07" * 8),  # other data size
        Message(5, cached=0b101, numbered=[(2, 9)], eager=b"\x07" * 16, joined_cycle=4),
        Message(5, cached=0b101, numbered=[(2, 9)], eager=b"\x07" * 16, shutdown=True),
        Message(5, cached=0b101, new=[("w", Signature(Kind.BARRIER), 0)]),  # pickled
    ],
    ids=["slots", "number", "data-size", "joined", "shutdown", "new-request"],
)
def test_a_peer_with_anything_else_ready_is_decoded_in_full(peer):
    own = Message(5, cached=0b101, numbered=[(2, 9)], eager=b"\x01" * 16)
    wire = encode(own)
    received = [bytearray(encode(peer)), wire]
    assert same_form(wire, received) == 0
    assert messages(own, wire, received, 0) == [peer, own]


def test_a_long_phase_is_cut_to_255_bytes_on_theencode():
    message = Message(3, cached=1, activity=("x" * 300, 1.5))
    assert decode(encode(message)).activity == ("x" * 255, 1.5)
