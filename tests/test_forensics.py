"""Stacks from outside a process, their printing, and the flight record (one process
each; the multi-rank cases are in test_where.py)."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ringplug.forensics import flight, stacks
from ringplug.forensics.stacks import Frame, ProcessStacks, ThreadStack


def start_waiting_child(tmp_path, install: bool = True) -> subprocess.Popen[str]:
    """A Python process blocked in `wait_here` (reading its stdin), its handler installed."""
    code = textwrap.dedent(
        f"""
        import sys, threading
        from ringplug.forensics import stacks
        def helper_thread_body():
            threading.Event().wait()
        threading.Thread(target=helper_thread_body, name="helper", daemon=True).start()
        if {install!r}:
            stacks.install({str(tmp_path)!r})
        def wait_here():
            print("ready", flush=True)
            sys.stdin.readline()
        wait_here()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


def end(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait(timeout=30)


def test_stacks_taken_from_outside_show_each_thread_by_name_main_first(tmp_path):
    child = start_waiting_child(tmp_path)
    try:
        report = stacks.outside(child.pid, tmp_path)
    finally:
        end(child)
    # Waiting, though /proc may catch it running (its threads wake; under load, scheduled).
    assert report.pid == child.pid and report.state in ("sleeping", "running"), report.state
    names = [t.name for t in report.threads]
    assert names[0] == "MainThread" and report.threads[0].main
    assert "helper" in names
    main = report.threads[0]
    assert [f.function for f in main.frames][:2] == ["<module>", "wait_here"]
    helper = next(t for t in report.threads if t.name == "helper")
    assert any(f.function == "helper_thread_body" for f in helper.frames)


def test_a_process_without_the_handler_is_not_signalled(tmp_path):
    child = start_waiting_child(tmp_path, install=False)
    try:
        report = stacks.outside(child.pid, tmp_path)
        alive = child.poll() is None
    finally:
        end(child)
    assert alive  # the real-time signal's default action would have ended it
    assert report.threads == []
    assert "no stack handler" in report.note


def test_a_stopped_process_is_reported_stopped_without_waiting_for_it(tmp_path):
    child = start_waiting_child(tmp_path)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not stacks.process_state(child.pid).startswith("stopped"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        report = stacks.outside(child.pid, tmp_path, timeout=30)
    finally:
        end(child)
    assert report.state == "stopped (SIGSTOP or job control)"
    assert report.threads == [] and "no stacks to take" in report.note


def test_own_stacks_mark_the_innermost_user_frame():
    report = stacks.own_stacks(include_caller=True)
    lines = stacks.thread_lines(report.threads[0])
    marked = [line for line in lines if line.endswith("<-- innermost user frame")]
    assert len(marked) == 1
    assert "test_own_stacks_mark_the_innermost_user_frame" in marked[0]
    assert __file__ in marked[0]


def report(function: str, line: int = 3, state: str = "sleeping") -> ProcessStacks:
    frames = [Frame("/job/train.py", 1, "<module>"), Frame("/job/train.py", line, function)]
    return ProcessStacks(100 + line, state, [ThreadStack("MainThread", frames, True)])


def test_ranks_stuck_alike_print_once_with_their_ranks():
    reports = {r: report("allreduce_step") for r in (0, 2, 3, 5)}
    reports[1] = report("load_batch", line=9)
    reports[4] = report("allreduce_step", state="stopped (SIGSTOP or job control)")
    lines = stacks.grouped_lines(reports, {1: "b"})
    headers = [line for line in lines if not line.startswith(" ")]
    assert headers == [
        "ranks 0, 2-5 (sleeping, stopped (SIGSTOP or job control)):",
        "rank 1 on host b (pid 109, sleeping):",
    ]


def test_ranks_stuck_alike_group_whatever_ringplugs_own_threads_are_doing():
    # Between two idle cycles ringplug's engine thread is in one wait or another from moment
    # to moment: ranks stuck in the same user line still print once, and that line says
    # where each rank's engine thread was.
    def stuck(engine_at: str, engine_file: str) -> ProcessStacks:
        stacks_of = report("allreduce_step")
        engine = [Frame(f"/site/ringplug/{engine_file}", 7, engine_at)]
        stacks_of.threads.append(ThreadStack("ringplug-engine", engine))
        stacks_of.threads.append(
            ThreadStack("ringplug-heartbeat", [Frame("/s/stacks.py", 1, "beat")])
        )
        return stacks_of

    reports = {0: stuck("_sleep", "engine.py"), 2: stuck("wait", "threading.py")}
    reports[3] = stuck("wait", "threading.py")
    lines = stacks.grouped_lines(reports)
    assert lines[0] == "ranks 0, 2-3 (sleeping):"
    engine_line = (
        "  thread ringplug-engine: ringplug's, in _sleep (engine.py) on rank 0; "
        "in wait (threading.py) on ranks 2-3"
    )
    assert engine_line in lines
    assert "  thread ringplug-heartbeat: ringplug's, in beat (stacks.py)" in lines
    assert sum(line.startswith("    File ") for line in lines) == 2  # the user's stack once


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([0, 1, 2, 5, 7, 8], "0-2, 5, 7-8"), ([3], "3"), ([4, 2], "2, 4"), ([], "")],
)
def test_rank_ranges(ranks, text):
    assert stacks.rank_ranges(ranks) == text


def submit_from_here(recorder: flight.FlightRecorder, name: str) -> tuple[list, int]:
    recorder.note_site(name, depth=1)
    line = inspect.currentframe().f_lineno - 1
    return recorder.add(name, ("allreduce", 64), time.perf_counter()), line


def test_the_flight_record_keeps_the_last_collectives_with_their_call_sites():
    recorder = flight.FlightRecorder(3)
    lines = {}
    for n in range(5):
        entry, lines[n] = submit_from_here(recorder, f"t{n}")
        if n != 3:
            error = ValueError("bad") if n == 4 else None
            flight.finish(entry, 0.0, time.perf_counter(), error)
    records = recorder.records(lambda signature: signature)
    assert [(r["seq"], r["name"], r["state"]) for r in records] == [
        (2, "t2", "done"),
        (3, "t3", "pending"),
        (4, "t4", "failed"),
    ]
    assert records[2]["error"] == "ValueError: bad"
    assert records[0]["site"] == f"{__file__}:{lines[2]} in submit_from_here"
    assert records[0]["completed"] >= records[0]["submitted"]


def test_a_collective_taken_back_leaves_no_trace():
    recorder = flight.FlightRecorder(4)
    recorder.add("a", ("allreduce", 8), time.perf_counter(), track=True)
    recorder.forget("a")
    recorder.add("a", ("allreduce", 8), time.perf_counter())
    assert [r["seq"] for r in recorder.records(lambda s: s)] == [0]


def test_a_batch_longer_than_the_ring_records_its_last_collectives_numbered_in_sequence():
    class Request:
        def __init__(self, name: str) -> None:
            self.name, self.signature, self.submitted = name, ("allreduce", 4), 1.0
            self.flight, self.cacheable = None, True

    recorder = flight.FlightRecorder(4)
    recorder.add("first", ("allreduce", 4), 1.0)
    batch = [Request(f"b{n}") for n in range(10)]
    recorder.add_latest(batch)
    assert [r.flight is None for r in batch] == [True] * 6 + [False] * 4
    flight.finish(batch[-1].flight, 0.0, 2.0)
    recorder.add_latest([Request("after")])
    records = recorder.records(lambda signature: signature)
    assert [(r["seq"], r["name"]) for r in records] == [
        (8, "b7"),
        (9, "b8"),
        (10, "b9"),
        (11, "after"),
    ]
    assert [r["state"] for r in records] == ["pending", "pending", "done", "pending"]


def entry(seq: int, name: str, state: str = "done", site: str = "t.py:1 in f") -> dict:
    return {
        "seq": seq,
        "name": name,
        "kind": "allreduce",
        "bytes": 4,
        "site": site,
        "submitted": 0.0,
        "state": state,
        "error": None,
    }


def test_explain_names_the_collective_where_the_ranks_parted():
    ranks = {
        0: {"records": [entry(0, "a"), entry(1, "b", "pending", "t.py:5 in step")]},
        1: {"records": [entry(0, "a"), entry(1, "c", "pending", "t.py:9 in other")]},
    }
    lines = flight.explain(ranks, size=3)
    assert lines[0] == "the ranks parted at collective #1:"
    assert lines[1].startswith("  rank 0: allreduce 'b' (#1, 4 B, from t.py:5 in step), pending")
    assert lines[2].startswith("  rank 1: allreduce 'c' (#1, 4 B, from t.py:9 in other)")
    assert lines[-1].startswith("rank 2 wrote no flight record")


def test_explain_names_the_rank_that_never_submitted_what_the_others_wait_in():
    ranks = {
        0: {"records": [entry(0, "a"), entry(1, "b", "pending")]},
        1: {"records": [entry(0, "a", site="t.py:3 in g")]},
        2: {"records": [entry(0, "a"), entry(1, "b", "pending")]},
    }
    lines = flight.explain(ranks)
    assert lines[0].startswith("rank 1 never submitted collective #1, allreduce 'b'")
    assert lines[0].endswith("which ranks 0, 2 wait in")
    assert lines[1] == "  rank 1's last collective: allreduce 'a' (#0, 4 B, from t.py:3 in g), done"


def test_flight_files_that_are_not_records_are_named(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="x.json is not a ringplug flight record"):
        flight.load([path])
