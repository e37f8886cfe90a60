"""The flight record names the line of the user's code that made each synchronous call,
named or not, while it looks at as few frames as it can (issue 44), in a world of one."""

from __future__ import annotations

import inspect
import runpy
from pathlib import Path

import numpy as np
import pytest

import ringplug
from ringplug.core import runtime


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    ringplug.init()
    yield


def reduce_unnamed(buf: np.ndarray) -> int:
    ringplug.allreduce(buf, op=ringplug.Sum, out=buf)
    return inspect.currentframe().f_lineno - 1


def reduce_named(buf: np.ndarray) -> int:
    ringplug.allreduce(buf, op=ringplug.Sum, out=buf, name="sites.named")
    return inspect.currentframe().f_lineno - 1


def from_a_caller(buf: np.ndarray) -> int:
    return reduce_unnamed(buf)  # the site is the innermost user frame, not this one


def test_each_synchronous_call_records_the_users_line_that_made_it():
    engine = runtime.engine()
    buf = np.zeros(4, np.float32)
    calls_before = engine.counters.fast_by_callers
    # Repeated, so that the frames above are known to the record (the short way is taken).
    unnamed = [from_a_caller(buf) for _ in range(4)]
    named = [reduce_named(buf) for _ in range(4)]
    # most ran their whole cycle on the caller's thread, negotiated by the fast path
    assert engine.counters.fast_by_callers - calls_before >= 6
    sites = [record["site"] for record in engine.flight.records(lambda s: ("allreduce", 0))]
    assert (
        sites[-8:]
        == [f"{__file__}:{unnamed[0]} in reduce_unnamed"] * 4
        + [f"{__file__}:{named[0]} in reduce_named"] * 4
    )


def test_a_call_at_a_scripts_top_level_records_that_line(tmp_path: Path):
    # A script's top level is one code object holding every constant of the script; the
    # record knows it as it knows a function's (and names its line, not a ringplug frame).
    script = tmp_path / "train.py"
    script.write_text(
        "import numpy as np\n"
        "import ringplug\n"
        "buf = np.zeros(4, np.float32)\n"
        "for _ in range(3):\n"
        "    ringplug.allreduce(buf, op=ringplug.Sum, out=buf)\n"
    )
    runpy.run_path(str(script))
    engine = runtime.engine()
    sites = [record["site"] for record in engine.flight.records(lambda s: ("allreduce", 0))]
    assert sites[-3:] == [f"{script}:5 in <module>"] * 3


def torch_in_place(tensor) -> int:
    import ringplug.torch as rpt

    rpt.allreduce_(tensor, "sum")
    return inspect.currentframe().f_lineno - 1


def torch_new(tensor) -> int:
    import ringplug.torch as rpt

    rpt.allreduce(tensor, "sum")
    return inspect.currentframe().f_lineno - 1


def through_horovod(tensor) -> int:
    import ringplug.horovod.torch as hvd

    hvd.allreduce(tensor, op=hvd.Sum)  # reaches ringplug.torch.allreduce, further up
    return inspect.currentframe().f_lineno - 1


def nested(call, tensor, depth: int) -> int:
    if depth == 0:
        return call(tensor)
    if depth == 1:  # a call of its own: the record knows this function as the user's
        ringplug.allreduce(np.zeros(1, np.float32), op=ringplug.Sum)
    return nested(call, tensor, depth - 1)


def test_calls_through_framework_layers_record_the_users_line_whatever_way_they_came():
    # ringplug.torch.allreduce is reached from the user's code and from Horovod's API: the
    # record remembers the way up from it, and must not take one way for the other. Each
    # call is made from deep in the user's code, so that the frame as high above
    # ringplug.torch.allreduce as the user's frame was on the other way is the user's too,
    # the wrong one.
    torch = pytest.importorskip("torch")
    engine = runtime.engine()
    tensor = torch.zeros(4)
    calls = [torch_in_place, through_horovod, torch_new, through_horovod, torch_new, torch_in_place]
    lines = [nested(call, tensor, 6) for call in calls for _ in range(2)]
    records = engine.flight.records(lambda s: ("allreduce", 0))
    sites = [record["site"] for record in records if not record["site"].endswith(" nested")]
    assert sites[-12:] == [
        f"{__file__}:{line} in {call.__name__}"
        for call, line in zip([c for c in calls for _ in range(2)], lines, strict=True)
    ]


def test_a_synchronous_torch_call_runs_its_cycle_itself_and_wakes_no_engine_thread():
    torch = pytest.importorskip("torch")
    import ringplug.horovod.torch as hvd
    import ringplug.torch as rpt

    scheduler = runtime.engine().scheduler
    tensor = torch.ones(3)
    calls = [
        lambda: rpt.allreduce_(tensor, "sum"),
        lambda: rpt.allreduce(tensor, "sum", prescale_factor=2.0),
        lambda: rpt.broadcast_(tensor, 0),
        lambda: rpt.allgather(tensor),
        lambda: hvd.allreduce_(tensor, op=hvd.Sum),
        lambda: hvd.broadcast_(tensor, 0),
    ]
    rings = scheduler.rings
    for call in calls * 5:
        call()
    assert scheduler.rings == rings
    # An asynchronous call does wake it (the engine thread sleeps while nothing is queued).
    for _ in range(5):
        rpt.allreduce_async_(tensor, "sum").wait()
    assert scheduler.rings > rings
