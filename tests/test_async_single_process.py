"""The async forms and handles, in a world of one."""

from __future__ import annotations

import numpy as np
import pytest

import ringplug


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    ringplug.init()
    yield


def test_async_collectives_return_handles_that_give_the_result():
    data = np.arange(4.0)
    handles = [
        ringplug.allreduce_async(data, op="sum", name="a"),
        ringplug.allgather_async(data, name="g"),
        ringplug.broadcast_async(data, 0, name="b"),
        ringplug.reducescatter_async(data.reshape(2, 2), op="sum", name="r"),
    ]
    results = [ringplug.synchronize(handle) for handle in handles]
    assert all(ringplug.poll(handle) for handle in handles)
    assert [r.tolist() for r in results] == [
        [0.0, 1.0, 2.0, 3.0],
        [0.0, 1.0, 2.0, 3.0],
        [0.0, 1.0, 2.0, 3.0],
        [[0.0, 1.0], [2.0, 3.0]],
    ]


def test_grouped_allreduce_returns_new_arrays_in_their_shapes():
    first, second = np.ones((2, 3), np.float32), np.full(5, 2.0, np.float32)
    results = ringplug.grouped_allreduce([first, second], op="sum", postscale_factor=3.0)
    assert [r.shape for r in results] == [(2, 3), (5,)]
    assert results[0].tolist() == [[3.0] * 3] * 2 and results[1].tolist() == [6.0] * 5
    assert first.tolist() == [[1.0] * 3] * 2  # inputs untouched


def test_grouped_allreduce_in_place_returns_the_arrays_themselves():
    arrays = [np.ones((2, 2), np.float32), np.full(3, 2.0, np.float32)]
    results = ringplug.grouped_allreduce(arrays, op="sum", out=arrays, postscale_factor=3.0)
    assert results[0] is arrays[0] and results[1] is arrays[1]
    assert arrays[0].tolist() == [[3.0, 3.0]] * 2 and arrays[1].tolist() == [6.0] * 3


def test_grouped_allreduce_into_other_arrays_leaves_the_inputs_alone():
    inputs = [np.ones((2, 2), np.float32), np.full(3, 2.0, np.float32)]
    # Side by side in one buffer: the engine reduces there, after copying the inputs in.
    buffer = np.zeros(7, np.float32)
    outputs = [buffer[:4].reshape(2, 2), buffer[4:]]
    results = ringplug.grouped_allreduce(inputs, op="sum", out=outputs, postscale_factor=3.0)
    assert results[0] is outputs[0] and results[1] is outputs[1]
    assert outputs[0].tolist() == [[3.0, 3.0]] * 2 and outputs[1].tolist() == [6.0] * 3
    assert inputs[0].tolist() == [[1.0, 1.0]] * 2 and inputs[1].tolist() == [2.0] * 3


def test_grouped_allreduce_into_views_of_the_inputs_is_in_place():
    inputs = [np.ones(4, np.float32), np.full(3, 2.0, np.float32)]
    views = [inputs[0].view(), inputs[1][:]]  # other objects, the same memory
    ringplug.grouped_allreduce(inputs, op="sum", out=views, postscale_factor=3.0)
    assert inputs[0].tolist() == [3.0] * 4 and inputs[1].tolist() == [6.0] * 3


def test_grouped_allreduce_refuses_mixed_dtypes():
    with pytest.raises(TypeError, match="arrays of one dtype"):
        ringplug.grouped_allreduce([np.ones(2, np.float32), np.ones(2)])


def test_a_name_still_in_flight_cannot_be_reused():
    data = np.ones(3)
    handle = ringplug.allreduce_async(data, name="busy")
    try:
        with pytest.raises(ValueError, match="already in flight"):
            ringplug.allreduce_async(data, name="busy")
    finally:
        handle.wait()
    assert ringplug.allreduce_async(data, name="busy").wait().tolist() == [1.0] * 3


def test_join_alone_returns_this_rank():
    assert ringplug.join() == 0


def test_results_reach_outputs_that_are_not_contiguous():
    values = np.arange(24.0).reshape(4, 6)
    out = np.zeros((6, 4)).T  # strided, shape (4, 6)
    assert ringplug.allreduce_async(values, op="sum", out=out, name="strided-out").wait() is out
    assert np.array_equal(out, values)
    columns = np.arange(24.0).reshape(4, 6)[:, ::2]  # strided, reduced in place
    expected = columns.copy()
    handle = ringplug.allreduce_async(columns, op="sum", out=columns, name="strided-in-place")
    assert handle.wait() is columns and np.array_equal(columns, expected)
