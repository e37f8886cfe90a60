"""`Handle` outcomes and callbacks, alone and finished as a fused batch (`finish_each`)."""

from __future__ import annotations

import logging

import pytest

from ringplug.core.engine.handles import Handle, finish_each


def test_a_batch_finishes_every_handle_with_its_own_outcome():
    handles = [Handle(f"t{i}") for i in range(3)]
    error = ValueError("rank 1 said no")
    finish_each(handles, ["zero", None, 2], [None, error, None])
    assert all(h.done() for h in handles)
    assert handles[0].wait() == "zero" and handles[2].wait() == 2
    with pytest.raises(ValueError, match="rank 1 said no"):
        handles[1].wait()


def test_callbacks_added_before_a_batch_finishes_run_once_after_it(caplog):
    first, second, third = Handle("a"), Handle("b"), Handle("c")
    seen = []

    def broken(handle):
        raise RuntimeError("a user's callback failed")

    first.add_done_callback(lambda h: seen.append((h.name, h.done(), h.wait())))
    first.add_done_callback(broken)
    third.add_done_callback(lambda h: seen.append((h.name, h.done(), h.wait())))
    assert seen == []
    with caplog.at_level(logging.ERROR):
        finish_each([first, second, third], [1, 2, 3], [None, None, None])
    # Each callback ran once, with its handle done; a failing one was logged, not raised.
    assert seen == [("a", True, 1), ("c", True, 3)]
    assert "a callback of collective 'a' failed" in caplog.text
    # Added afterwards: runs at once, and the batch's are not run again.
    second.add_done_callback(lambda h: seen.append((h.name, h.done(), h.wait())))
    assert seen == [("a", True, 1), ("c", True, 3), ("b", True, 2)]


def test_a_handle_finished_alone_runs_its_callbacks_once():
    handle, seen = Handle("x"), []
    handle.add_done_callback(seen.append)
    handle._finish(result=5)
    handle.add_done_callback(seen.append)
    assert seen == [handle, handle] and handle.wait() == 5
