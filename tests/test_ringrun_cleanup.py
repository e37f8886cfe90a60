"""A job's end ends everything its ranks started, whatever way the job ends.

Each rank of tests/workers/children.py starts helpers as a training script starts a
preprocessing helper, a TensorBoard or a server: a child, a child in a session of its own,
and an orphan in a session of its own whose parent exited at once (out of reach of the
ranks' process group); the tests check that every one is gone within 10 s of ringrun's end.
The jobs need no MPI and end at once, so each costs about the launcher's start.
The same on several hosts is in test_multihost.py, and for a self-launched Lightning job in
test_lightning_strategy.py (whose failing job starts the helpers too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import RINGRUN, helpers_left, processes_matching, run_ringrun, unique_marker
from ringplug.run.launch import wrapper as wrapper_module
from ringplug.run.launch.tree import Survivor, descendants, end_descendants
from ringplug.run.launch.wrapper import RankWrapper

pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "children.py")
# The bound, from the job's end to the last helper gone.
BOUND_S = 10.0
JOB_TIMEOUT_S = 30


def children_job(folder: Path, how: str, *flags: str, stubborn: bool = False):
    marker = unique_marker(f"children-{how}")
    extra = ["stubborn"] if stubborn else []
    result = run_ringrun(
        "-np", "3", *flags, sys.executable, WORKER, str(folder), how, *extra, marker,
        timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    return result, marker


def ranks_gone(marker: str) -> bool:
    """Whether the ranks themselves ended, within `BOUND_S` (after a SIGKILL to ringrun they
    go down while ringrun is already gone)."""
    deadline = time.monotonic() + BOUND_S
    while processes_matching(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_killed_rank_ends_the_helpers_of_every_rank_even_one_ignoring_sigterm(tmp_path):
    result, marker = children_job(tmp_path, "kill", stubborn=True)
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert "ringrun: rank 2 " in result.stderr
    assert helpers_left(tmp_path, bound_s=BOUND_S) == []
    assert processes_matching(marker) == []
    assert "is still running" not in result.stdout + result.stderr


def test_a_job_that_ends_well_leaves_no_helper(tmp_path):
    result, marker = children_job(tmp_path, "exit")
    assert result.returncode == 0, result.stderr
    assert helpers_left(tmp_path, bound_s=BOUND_S) == []
    assert processes_matching(marker) == []


def test_a_restart_follows_the_end_of_every_helper_of_the_failed_start(tmp_path):
    # The first start's rank 2 is killed; the restarted ranks check that the first start's
    # helpers are gone (waiting up to 10 s), then end well, and so must their own helpers.
    result, marker = children_job(tmp_path, "restart", "--max-restarts", "1")
    assert result.returncode == 0, result.stderr
    assert "ringrun: restart 1 of 1 after rank 2" in result.stderr
    assert {path.name: path.read_text() for path in tmp_path.glob("gone.*")} == {
        f"gone.{rank}": "yes" for rank in range(3)
    }
    assert helpers_left(tmp_path, "children.1.*", bound_s=BOUND_S) == []
    assert processes_matching(marker) == []


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_ringrun_stopped_by_a_signal_leaves_no_helper(tmp_path, stop):
    marker = unique_marker("children-stopped")
    env = {k: v for k, v in os.environ.items() if k != "RINGPLUG_MPIEXEC"}
    command = [*RINGRUN, "-np", "3", sys.executable, WORKER, str(tmp_path), "block", marker]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(list(tmp_path.glob("children.0.?"))) < 3:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the ranks did not start their helpers"
            time.sleep(0.05)
        process.send_signal(stop)
        _, stderr = process.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert process.returncode == (-stop if stop == signal.SIGKILL else 128 + stop), stderr
    assert helpers_left(tmp_path, bound_s=BOUND_S) == []
    assert ranks_gone(marker)


def test_a_helper_that_outlives_sigkill_is_returned_with_its_command_line():
    # Such a process sleeps uninterruptibly (a hung disk or driver); this `send` makes one by
    # losing the SIGKILL meant for it. Its parent stands in for the wrapper.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time\n"
            "helper = subprocess.Popen(['sh', '-c', \"trap '' TERM; exec sleep 300\"])\n"
            f"deadline = time.monotonic() + {BOUND_S}\n"
            "while open(f'/proc/{helper.pid}/cmdline').read() != 'sleep\\x00300\\x00':\n"
            "    assert time.monotonic() < deadline, 'the shell did not become sleep'\n"
            "    time.sleep(0.01)  # the trap is set once the shell became sleep\n"
            "print(helper.pid, flush=True)\n"
            "time.sleep(300)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    helper = int(parent.stdout.readline())
    sent: list[tuple[int, int]] = []

    def send(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        if sig != signal.SIGKILL:
            os.kill(pid, sig)

    try:
        survivors = end_descendants(parent.pid, grace_s=0.3, kill_wait_s=0.3, send=send)
    finally:
        os.kill(helper, signal.SIGKILL)
        parent.kill()
        parent.wait(timeout=10)
    assert [survivor.pid for survivor in survivors] == [helper]
    assert survivors[0].command == "sleep 300"
    assert (helper, signal.SIGTERM) in sent and (helper, signal.SIGKILL) in sent


def test_descendants_are_found_with_or_without_the_kernels_children_files():
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess\nsubprocess.run(['sh', '-c', 'sleep 300; :'])"]
    )
    try:
        deadline = time.monotonic() + BOUND_S
        while len(found := descendants(parent.pid, children_files=True)) < 2:
            assert time.monotonic() < deadline, "the shell did not start sleep"
            time.sleep(0.01)
        assert sorted(descendants(parent.pid, children_files=False)) == sorted(found)
    finally:
        end_descendants(parent.pid, grace_s=0)
        parent.wait(timeout=10)


def test_the_wrapper_names_a_survivor_with_its_host_and_how_to_end_it(capfd):
    wrapper = RankWrapper(["true"], environ={"PMI_RANK": "1", "PMI_SIZE": "3"})
    wrapper._name_survivors([Survivor(4242, "sleep 300", "in uninterruptible sleep")])
    line = capfd.readouterr().err
    assert line.startswith("ringrun: rank 1 on host ")
    assert "process 4242 (sleep 300), in uninterruptible sleep is still running 3 s after" in line
    assert "`kill -9 -- 4242`" in line


def test_a_program_ignoring_the_stop_is_killed_when_nobody_else_will(monkeypatch):
    # With ringrun SIGKILLed, its launcher passes SIGTERM on and then waits for the ranks
    # forever; the wrapper kills a program that ignores it, after the time ringrun would
    # have given it (shortened here).
    monkeypatch.setattr(wrapper_module, "STOP_BACKSTOP_S", 0.2)
    wrapper = RankWrapper(["true"], environ={"PMI_RANK": "0", "PMI_SIZE": "1"})
    wrapper.child = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 300"])
    try:
        deadline = time.monotonic() + BOUND_S
        while Path(f"/proc/{wrapper.child.pid}/cmdline").read_bytes() != b"sleep\x00300\x00":
            assert time.monotonic() < deadline, "the shell did not become sleep"
            time.sleep(0.01)  # the trap is set once the shell became sleep
        wrapper._forward(signal.SIGTERM, None)
        assert wrapper.child.wait(timeout=BOUND_S) == -signal.SIGKILL
    finally:
        wrapper.child.kill()
        wrapper.child.wait(timeout=10)
