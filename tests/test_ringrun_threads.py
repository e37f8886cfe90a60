"""ringrun gives each rank its share of its host's cores as OMP_NUM_THREADS, unless the user
chose a value (or turned it off); the ranks' own thread split agrees with it."""

from __future__ import annotations

import os
import sys

import pytest

from launch import run_ringrun
from ringplug.core import runtime
from ringplug.run.launch.threads import thread_variables, threads_note
from ringplug.wire import THREADS_VARIABLE

PRINT_THREADS = (
    "import os; print(os.environ['RANK'], os.environ.get('OMP_NUM_THREADS'), "
    f"os.environ.get('{THREADS_VARIABLE}'))"
)


def ranks_said(stdout: str) -> dict[str, list[str]]:
    """{rank: [OMP_NUM_THREADS, marker]} from PRINT_THREADS's lines."""
    return {
        words[1]: words[2:]
        for words in (line.split() for line in stdout.splitlines())
        if len(words) == 4
    }


def test_each_rank_gets_its_share_of_the_hosts_cores():
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    result = run_ringrun("-np", "2", sys.executable, "-c", PRINT_THREADS, env=env)
    assert result.returncode == 0, result.stderr
    assert ranks_said(result.stdout) == {"0": [share, share], "1": [share, share]}
    # Said once, to a terminal or with --verbose; a piped job's first line stays its verdict.
    assert "OMP_NUM_THREADS" not in result.stderr


def test_the_users_omp_num_threads_is_left_alone():
    result = run_ringrun("-np", "2", "-x", "OMP_NUM_THREADS=3", sys.executable, "-c", PRINT_THREADS)
    assert result.returncode == 0, result.stderr
    assert ranks_said(result.stdout) == {"0": ["3", "None"], "1": ["3", "None"]}


@pytest.mark.parametrize(
    ("environ", "cores", "expected"),
    [
        ({"MPI_LOCALNRANKS": "2"}, 2, "1"),  # hydra, 2 ranks on 2 cores
        ({"MPI_LOCALNRANKS": "4"}, 2, "1"),  # more ranks than cores: still one thread
        ({"MPI_LOCALNRANKS": "1"}, 16, "16"),  # a lone rank on its host takes every core
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 16, "5"),  # Open MPI
        ({"MPI_LOCALNRANKS": "2", "OMP_NUM_THREADS": "7"}, 16, None),  # the user's choice
        ({"MPI_LOCALNRANKS": "2", "RINGPLUG_SPLIT_THREADS": "0"}, 16, None),  # turned off
        ({}, 16, None),  # no launcher said how many ranks share the host
    ],
)
def test_share_follows_this_hosts_rank_count(environ, cores, expected):
    found = thread_variables(environ, cores=cores)
    if expected is None:
        assert found == {}
    else:
        assert found == {"OMP_NUM_THREADS": expected, THREADS_VARIABLE: expected}


def test_the_ranks_split_keeps_giving_ringruns_share_but_not_the_users(monkeypatch):
    # TensorFlow's pools ignore OMP_NUM_THREADS: ringplug.keras.init() sizes them from
    # threads_per_rank(), which must not take ringrun's value for the user's.
    monkeypatch.setattr(runtime, "local_size", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv(THREADS_VARIABLE, "4")
    assert runtime.threads_per_rank() == 4
    monkeypatch.delenv(THREADS_VARIABLE)
    assert runtime.threads_per_rank() is None  # the user's value: theirs to keep
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert runtime.threads_per_rank() == 4


def test_the_note_names_the_share_and_the_ways_out():
    note = threads_note(2, True, {}, {})
    assert note is not None
    assert "cores // ranks on that host (here " in note
    assert "-x OMP_NUM_THREADS=N" in note and "RINGPLUG_SPLIT_THREADS=0" in note
    assert threads_note(1, True, {}, {}) is None  # one rank: nothing is shared
    assert threads_note(2, True, {"OMP_NUM_THREADS": "2"}, {}) is None
    assert threads_note(2, True, {}, {"OMP_NUM_THREADS": "2"}) is None  # -x
    assert threads_note(2, False, {}, {"RINGPLUG_SPLIT_THREADS": "0"}) is None


def test_a_split_setting_that_is_no_switch_stops_ringrun_before_the_job():
    env = {**os.environ, "RINGPLUG_SPLIT_THREADS": "maybe"}
    env.pop("OMP_NUM_THREADS", None)
    result = run_ringrun("-np", "2", sys.executable, "-c", "print('ran')", env=env)
    assert result.returncode == 2
    assert "ran" not in result.stdout
    assert "RINGPLUG_SPLIT_THREADS='maybe': use 1 (on) or 0 (off)" in result.stderr
