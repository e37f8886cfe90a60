"""Real ringrun jobs with the virtualenv's MPICH hydra: output, failures and cleanup."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from launch import processes_matching, run_ringrun, unique_marker

pytestmark = pytest.mark.multirank

# Bounds for whole jobs; a job that hangs fails its test here instead of blocking the suite.
JOB_TIMEOUT_S = 30
FAILED_JOB_TIMEOUT_S = 15

BLOCK_FOREVER = "threading.Event().wait()"


def rank_program(body: str, marker: str) -> list[str]:
    """``python -c`` arguments for a rank; ``marker`` rides along in argv to find leftovers."""
    code = "import os, sys, signal, threading\nrank = int(os.environ['PMI_RANK'])\n"
    return [sys.executable, "-c", code + textwrap.dedent(body), marker]


def test_every_rank_prints_lines_prefixed_with_its_rank():
    marker = unique_marker("hello")
    program = rank_program("print('hello from', rank, 'of', os.environ['PMI_SIZE'])", marker)
    result = run_ringrun("-np", "2", *program, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    assert lines == ["[0] hello from 0 of 2", "[1] hello from 1 of 2"]


def test_ranks_get_unbuffered_python_and_forwarded_variables():
    marker = unique_marker("env")
    program = rank_program(
        "print(os.environ.get('PYTHONUNBUFFERED'), os.environ.get('FOO'),"
        " os.environ.get('RINGPLUG_TEST_SETTING'), os.environ['VIRTUAL_ENV'])",
        marker,
    )
    result = run_ringrun(
        "-np",
        "2",
        "-x",
        "FOO=bar",
        *program,
        extra_env={"RINGPLUG_TEST_SETTING": "on", "VIRTUAL_ENV": "/some/venv"},
        timeout=JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[0] 1 bar on /some/venv",
        "[1] 1 bar on /some/venv",
    ]


def test_lines_printed_in_pieces_keep_one_rank_prefix():
    marker = unique_marker("pieces")
    # Unbuffered print writes "a", " ", "b", "\n" separately; hydra tags every chunk it reads.
    program = rank_program("print('a', 'b', 'c')", marker)
    result = run_ringrun("-np", "2", *program, timeout=JOB_TIMEOUT_S)
    assert sorted(result.stdout.splitlines()) == ["[0] a b c", "[1] a b c"]


def test_failing_rank_stops_the_job_and_is_named():
    marker = unique_marker("exit3")
    program = rank_program(
        f"""
        print('pid', os.getpid(), flush=True)
        if rank == 1:
            sys.exit(3)
        {BLOCK_FOREVER}
        """,
        marker,
    )
    result = run_ringrun("-np", "2", *program, timeout=FAILED_JOB_TIMEOUT_S)
    pid = re.search(r"\[1\] pid (\d+)", result.stdout).group(1)
    assert result.returncode == 3
    assert re.search(
        rf"ringrun: rank 1 on host \S+ \(pid {pid}\) exited with code 3", result.stderr
    ), result.stderr
    assert processes_matching(marker) == []


def test_rank_killed_by_a_signal_is_named_with_the_signal():
    marker = unique_marker("sigkill")
    program = rank_program(
        f"""
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        {BLOCK_FOREVER}
        """,
        marker,
    )
    result = run_ringrun("-np", "2", *program, timeout=FAILED_JOB_TIMEOUT_S)
    assert result.returncode == 128 + 9
    assert re.search(
        r"ringrun: rank 0 on host \S+ \(pid \d+\) was killed by signal SIGKILL", result.stderr
    ), result.stderr
    assert processes_matching(marker) == []


def test_rank_that_ignores_sigterm_is_still_stopped():
    marker = unique_marker("stubborn")
    program = rank_program(
        f"""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rank == 1:
            sys.exit(4)
        {BLOCK_FOREVER}
        """,
        marker,
    )
    result = run_ringrun("-np", "2", *program, timeout=FAILED_JOB_TIMEOUT_S)
    assert result.returncode == 4
    assert "rank 1 on host" in result.stderr
    assert processes_matching(marker) == []


def test_first_failure_is_named_not_the_ranks_killed_after_it():
    marker = unique_marker("cascade")
    # Rank 2 fails; ranks 0 and 1 die by SIGTERM in the teardown and report that too.
    program = rank_program(
        f"""
        if rank == 2:
            sys.exit(6)
        {BLOCK_FOREVER}
        """,
        marker,
    )
    result = run_ringrun("-np", "3", *program, timeout=FAILED_JOB_TIMEOUT_S)
    assert result.returncode == 6
    assert re.search(
        r"ringrun: rank 2 on host \S+ \(pid \d+\) exited with code 6", result.stderr
    ), result.stderr
    assert processes_matching(marker) == []


def test_output_filename_writes_each_ranks_output_to_its_own_files(tmp_path):
    marker = unique_marker("outfiles")
    program = rank_program("print('out', rank); print('err', rank, file=sys.stderr)", marker)
    result = run_ringrun(
        "-np",
        "2",
        "--output-filename",
        str(tmp_path / "logs"),
        *program,
        timeout=JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        directory = tmp_path / "logs" / f"rank.{rank}"
        assert (directory / "stdout").read_text() == f"out {rank}\n"
        assert (directory / "stderr").read_text() == f"err {rank}\n"
    assert sorted(result.stdout.splitlines()) == ["[0] out 0", "[1] out 1"]


def test_sigterm_to_ringrun_stops_every_rank(tmp_path):
    import os
    import signal
    import subprocess

    from launch import RINGRUN

    marker = unique_marker("sigterm")
    ready = tmp_path / "ready"
    program = rank_program(
        f"""
        open(os.path.join({str(tmp_path)!r}, f'ready.{{rank}}'), 'w').close()
        {BLOCK_FOREVER}
        """,
        marker,
    )
    env = {k: v for k, v in os.environ.items() if k != "RINGPLUG_MPIEXEC"}
    process = subprocess.Popen(
        [*RINGRUN, "-np", "2", *program],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Wait (bounded) until both ranks run, by watching for the files they create.
        for _ in range(300):
            if len(list(tmp_path.glob("ready.*"))) == 2:
                break
            try:
                process.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                pass
        assert len(list(tmp_path.glob("ready.*"))) == 2, "ranks did not start"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=FAILED_JOB_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert process.returncode == 128 + signal.SIGTERM
    assert "stopped" in stderr
    assert processes_matching(marker) == []
    assert not ready.exists()


@pytest.mark.parametrize("first", ["the proxy fails first", "a rank starts first"])
def test_a_host_where_no_rank_started_is_named_whichever_order_the_launcher_failed_in(first):
    # hydra cannot start its proxy on host b and kills what it started: under load rank 0 on
    # host a has started by then, and reports starting but never how it ended.
    from ringplug.run.cli import verdict_lines
    from ringplug.run.hosts.spec import Host
    from ringplug.run.launch.job import JobResult
    from ringplug.run.launch.mpi import JobSpec
    from ringplug.run.launch.status import RankStarted
    from ringplug.run.settings import RunSettings

    started = {0: RankStarted(0, "node-a", 100)} if first == "a rank starts first" else {}
    result = JobResult(
        exit_code=255,
        launcher_returncode=255,
        started=started,
        unreported=list(started),
        start_errors=["bash: line 1: /venv/bin/hydra_pmi_proxy: No such file or directory"],
    )
    spec = JobSpec(
        np=2, command=["python", "-c", "pass"], hosts=[Host("node-a", 1), Host("node-b", 1)]
    )
    lines = verdict_lines(result, spec, RunSettings())
    named = [line for line in lines if line.startswith("no rank started on host")]
    assert len(named) == 1 and "node-b" in named[0], lines
    assert ("node-a" in named[0]) == (first == "the proxy fails first"), lines
    assert any("hydra_pmi_proxy: No such file" in line for line in lines), lines
