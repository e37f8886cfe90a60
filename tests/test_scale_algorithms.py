"""The O(log p) schedules in one process: the negotiation's rounds (Bruck's allgather) and
recursive doubling, simulated rank by rank for every p up to 40, against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ringplug.config import Settings
from ringplug.core.dtypes import DType
from ringplug.core.engine.engine import eager_threshold
from ringplug.core.engine.exchange import pack, rounds, unpack
from ringplug.core.ops import ReduceOp
from ringplug.core.transport import doubling
from ringplug.core.transport.reduce import combine

SIZES = list(range(1, 41))


@pytest.mark.parametrize("size", SIZES)
def test_every_rank_gets_every_message_in_ceil_log2_p_rounds(size):
    plans = [rounds(rank, size) for rank in range(size)]
    assert all(len(plan) == math.ceil(math.log2(size)) for plan in plans)
    held = [{rank: f"message of {rank}".encode() * (rank + 1)} for rank in range(size)]
    for round_ in range(len(plans[0])):
        sent = {}
        for rank, plan in enumerate(plans):
            target, _, count = plan[round_]
            blocks = [held[rank][(rank + i) % size] for i in range(count)]
            sent[(rank, target)] = pack(blocks)
        for rank, plan in enumerate(plans):
            _, source, count = plan[round_]
            wire = bytearray(sent.pop((source, rank)))  # the source sent to this rank
            for i, block in enumerate(unpack(wire, count)):
                held[rank][(source + i) % size] = bytes(block)
        assert not sent  # every message sent was received
    for rank in range(size):
        assert held[rank] == {r: f"message of {r}".encode() * (r + 1) for r in range(size)}


@pytest.mark.parametrize("size", SIZES)
def test_the_rounds_tell_every_rank_whether_one_rank_sent_another_form(size):
    # `Exchange.agree`: in round k each rank combines what it holds with what rank + 2^k
    # held, into the form or the mark that two differed; after the rounds every rank's
    # result stands for every rank.
    plans = [rounds(rank, size) for rank in range(size)]
    for odd in [None, *range(size)]:
        state = [{rank} if rank != odd else set() for rank in range(size)]  # ranks seen
        same = [rank != odd for rank in range(size)]
        for round_ in range(len(plans[0])):
            before = [(set(seen), ok) for seen, ok in zip(state, same, strict=True)]
            for rank, plan in enumerate(plans):
                _, source, _ = plan[round_]
                state[rank] |= before[source][0] | {source}
                same[rank] = same[rank] and before[source][1]
        assert all(seen | {rank} == set(range(size)) for rank, seen in enumerate(state))
        assert same == [odd is None] * size


def simulate_doubling(values: list[np.ndarray], op: ReduceOp, code: DType) -> list[np.ndarray]:
    """Every rank's result of `doubling.allreduce`, its schedule run rank by rank."""
    size = len(values)
    bufs = [v.copy() for v in values]
    schedule = [doubling.steps(rank, size) for rank in range(size)]
    # Pairing up: each even rank of the first pairs hands its buffer to the odd one.
    for rank, (pairing, _, sits_out) in enumerate(schedule):
        if pairing is not None and not sits_out:
            incoming = bufs[pairing].copy()
            doubling._combine_in_order(bufs[rank], incoming, pairing < rank, op, code)
    depth = max(len(partners) for _, partners, _ in schedule)
    for step in range(depth):
        before = [b.copy() for b in bufs]
        for rank, (_, partners, sits_out) in enumerate(schedule):
            if sits_out:
                continue
            partner = partners[step]
            assert schedule[partner][1][step] == rank  # partners agree
            incoming = before[partner].copy()
            doubling._combine_in_order(bufs[rank], incoming, partner < rank, op, code)
    for rank, (pairing, _, sits_out) in enumerate(schedule):
        if sits_out:
            bufs[rank] = bufs[pairing].copy()
    return bufs


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(
    ("op", "code"),
    [
        (ReduceOp.SUM, DType.FLOAT32),
        (ReduceOp.SUM, DType.FLOAT16),
        (ReduceOp.MAX, DType.FLOAT64),
        (ReduceOp.MIN, DType.INT32),
        (ReduceOp.PRODUCT, DType.INT64),
    ],
)
def test_recursive_doubling_matches_numpy_and_is_the_same_bits_everywhere(size, op, code):
    rng = np.random.default_rng(size)
    storage = code.storage
    if op is ReduceOp.PRODUCT:
        values = [rng.integers(-2, 3, 7).astype(storage) for _ in range(size)]
    else:
        values = [rng.integers(-8, 9, 7).astype(storage) for _ in range(size)]
    results = simulate_doubling(values, op, code)
    expected = values[0].copy()
    for other in values[1:]:
        combine(expected, other, op, code)  # integers: exact in every order
    for result in results:
        assert result.tobytes() == results[0].tobytes()
        np.testing.assert_array_equal(result, expected)
    # Random floats: not exact, but the same bits on every rank.
    floats = [rng.standard_normal(5).astype(np.float32) for _ in range(size)]
    results = simulate_doubling(floats, ReduceOp.SUM, DType.FLOAT32)
    assert len({r.tobytes() for r in results}) == 1
    np.testing.assert_allclose(results[0], np.sum(floats, axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", SIZES)
def test_recursive_doubling_sends_at_most_ceil_log2_p_plus_one_messages_per_rank(size):
    for rank in range(size):
        pairing, partners, sits_out = doubling.steps(rank, size)
        sends = len(partners) + (pairing is not None and not sits_out) + bool(sits_out)
        assert sends <= max(1, math.ceil(math.log2(size))) + (size > 1)
        assert len(partners) == (0 if sits_out else (1 << (size.bit_length() - 1)).bit_length() - 1)


@pytest.mark.parametrize(
    ("size", "carried"), [(1, 0), (2, 1), (3, 1), (7, 1), (8, 0), (9, 0), (64, 0)]
)
def test_small_allreduces_ride_in_the_negotiation_only_while_that_costs_little(size, carried):
    # (p - 1) n bytes to every peer against n ceil(log2 p) for recursive doubling.
    assert bool(eager_threshold(Settings(), size)) == bool(carried)
