"""A plain `python script.py` is a world of one: every collective still works."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import ringplug


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    ringplug.init()
    assert ringplug.size() == 1
    yield


def test_rank_facts_of_a_single_process():
    facts = (
        ringplug.rank(),
        ringplug.size(),
        ringplug.local_rank(),
        ringplug.local_size(),
        ringplug.cross_rank(),
        ringplug.cross_size(),
    )
    assert facts == (0, 1, 0, 1, 0, 1)


def test_init_twice_is_harmless():
    from ringplug.core import runtime

    engine = runtime.engine()
    ringplug.init()
    # The same engine goes on (a second one would start a second MPI world and thread).
    assert ringplug.is_initialized() and runtime.engine() is engine
    assert ringplug.allreduce(np.ones(3, np.float32), op=ringplug.Sum).tolist() == [1.0] * 3


def test_allreduce_of_one_rank_is_its_input_scaled():
    data = np.array([1.0, -2.0, 3.5], np.float32)
    result = ringplug.allreduce(data, op=ringplug.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert result.tolist() == [1.0, -2.0, 3.5]
    assert result is not data
    assert ringplug.allreduce(data, op="average").tolist() == data.tolist()


def test_allreduce_in_place_writes_into_the_input():
    data = np.arange(5, dtype=np.float64)
    assert ringplug.allreduce(data, op=ringplug.Sum, postscale_factor=3.0, out=data) is data
    assert data.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0]


def test_any_buffer_protocol_object_is_accepted():
    result = ringplug.allreduce(bytearray(b"\x01\x02"), op=ringplug.Max)
    assert result.dtype == np.uint8
    assert result.tolist() == [1, 2]


def test_bfloat16_words_are_scaled_in_float32():
    words = np.array([0x3F80, 0x4000], np.uint16)  # 1.0, 2.0
    result = ringplug.allreduce(words, op=ringplug.Sum, postscale_factor=0.5, dtype="bfloat16")
    assert result.tolist() == [0x3F00, 0x3F80]  # 0.5, 1.0


def test_a_framework_tensor_type_is_pointed_to_its_adapter():
    with pytest.raises(TypeError, match=r"ringplug\.torch / ringplug\.keras"):
        ringplug.allreduce([1.0, 2.0])


def test_reducescatter_of_one_rank_returns_every_row():
    data = np.arange(6.0).reshape(3, 2)
    assert ringplug.reducescatter(data, op=ringplug.Sum).tolist() == data.tolist()


def test_alltoall_of_one_rank_returns_its_rows_and_count():
    received, counts = ringplug.alltoall(np.arange(4))
    assert received.tolist() == [0, 1, 2, 3]
    assert counts.tolist() == [4]


def test_objects_round_trip():
    assert ringplug.broadcast_object({"a": 1}) == {"a": 1}
    assert ringplug.allgather_object("x") == ["x"]


def test_collectives_before_init_say_to_call_init():
    code = "import ringplug, numpy as np\nringplug.allreduce(np.ones(2))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0
    assert "Call ringplug.init() before using ringplug's collectives" in result.stderr


def test_a_barrier_timeout_must_be_a_positive_number_of_seconds():
    ringplug.init()
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="barrier timeout"):
            ringplug.barrier(timeout=bad)
    ringplug.barrier(timeout=0.5)  # one rank: every rank has arrived
    with pytest.raises(ValueError, match="barrier timeout"):  # the engine still takes calls
        ringplug.barrier(timeout=-2)


def test_a_new_fusion_threshold_takes_effect_at_the_next_cycle():
    """The cycle reads `Engine.settings` at its start (where autotuning changes it)."""
    import dataclasses

    from ringplug.core import runtime

    engine = runtime.engine()
    original = engine.settings

    def batches_of_four() -> int:
        # Held turn: the four requests queue, and the engine thread's next cycle takes
        # them all at once.
        with engine.scheduler.turn:
            handles = [
                ringplug.allreduce_async(np.ones(8, np.float32), op=ringplug.Sum, name=f"t{i}")
                for i in range(4)
            ]
        before = engine.counters.collectives_run
        assert [h.wait().tolist() for h in handles] == [[1.0] * 8] * 4
        return engine.counters.collectives_run - before

    try:
        assert batches_of_four() == 1  # fused: 128 bytes under the default threshold
        engine.settings = dataclasses.replace(original, fusion_threshold=16)
        assert batches_of_four() == 4  # each 32-byte tensor alone
    finally:
        engine.settings = original
    assert batches_of_four() == 1
