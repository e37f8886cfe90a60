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
