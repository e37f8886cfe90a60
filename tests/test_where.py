"""When a job hangs, ringrun shows where: the stuck rank's stacks, on stall and on demand,
and the ranks' flight records (issue 34). Real ranks, each hang planted in
``workers/hangs.py``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import RINGRUN, run_ringrun

pytestmark = pytest.mark.multirank

HANGS = str(Path(__file__).parent / "workers" / "hangs.py")
# A stall shows after 2 s; the job ends 8 s into it.
QUICK = {"RINGPLUG_STALL_CHECK_SECONDS": "2", "RINGPLUG_TIMEOUT": "8"}


def stuck_rank_report(stderr: str, rank: int) -> str:
    """ringrun's report of where `rank` is (from its header to the next non-report line)."""
    lines = stderr.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.startswith(f"ringrun: where rank {rank} ")),
        None,
    )
    assert start is not None, stderr
    report = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("ringrun:   "):
            break
        report.append(line)
    return "\n".join(report)


@pytest.mark.parametrize(
    ("scenario", "planted", "how"),
    [
        ("sleep", "planted_sleep", "rank 0 saw it stall"),
        ("deadlock", "planted_deadlock", "rank 0 saw it stall"),
        # The regular expression holds the interpreter lock: only the wrapper can tell.
        ("regex", "planted_regex", "no Python thread of it ran"),
    ],
)
def test_a_rank_stuck_in_user_code_is_shown_at_its_planted_function(scenario, planted, how):
    # Only the wrapper sees a rank whose C code holds the interpreter lock, once its
    # heartbeat is 2 s plus two beats old, and it then reads the stacks from outside: on a
    # loaded machine (a whole suite on 2 cores) that took longer than an 8 s job once.
    env = {**QUICK, "RINGPLUG_TIMEOUT": "14"} if scenario == "regex" else QUICK
    result = run_ringrun("-np", "2", sys.executable, HANGS, scenario, extra_env=env)
    assert result.returncode == 1, result.stderr
    report = stuck_rank_report(result.stderr, 1)
    assert how in report
    assert re.search(
        rf'File ".*hangs\.py", line \d+, in {planted}   <-- innermost user frame', report
    ), report
    assert "rank 1 stopped taking part in the job (named by rank 0)" in result.stderr


def test_a_dataloader_worker_that_never_returns_is_shown_with_its_own_stack():
    # The worker starts and hangs within the stall check's 4 s.
    slower = {**QUICK, "RINGPLUG_STALL_CHECK_SECONDS": "4"}
    result = run_ringrun("-np", "2", sys.executable, HANGS, "loader", extra_env=slower)
    assert result.returncode == 1, result.stderr
    report = stuck_rank_report(result.stderr, 1)
    main, _, child = report.partition("child process (")
    assert re.search(r"in planted_loader   <-- innermost user frame", main), report
    assert re.search(r"in planted_worker_hang   <-- innermost user frame", child), report
    assert re.search(r"^ringrun:   pid \d+, sleeping; child process \d+$", report, re.M), report


def test_a_stopped_rank_is_reported_as_stopped_by_its_wrapper():
    result = run_ringrun("-np", "2", sys.executable, HANGS, "sigstop", extra_env=QUICK)
    assert result.returncode == 1, result.stderr
    report = stuck_rank_report(result.stderr, 1)
    assert "stopped (SIGSTOP or job control)" in report
    assert "no stacks to take" in report
    assert "rank 1 stopped taking part in the job (named by rank 0)" in result.stderr


def test_ranks_in_different_collectives_show_their_call_sites_and_the_record_says_where():
    result = run_ringrun("-np", "2", sys.executable, HANGS, "other", extra_env=QUICK)
    assert result.returncode == 1, result.stderr
    assert "in planted_other_collective   <-- innermost user frame" in stuck_rank_report(
        result.stderr, 1
    )
    assert "in main   <-- innermost user frame" in stuck_rank_report(result.stderr, 0)
    found = re.search(r"ringrun: flight records of the ranks: (\S+) ", result.stderr)
    assert found, result.stderr
    explained = run_ringrun("--explain", found.group(1))
    assert explained.returncode == 0, explained.stderr
    lines = explained.stdout.splitlines()
    # grads.0-2 went alike; the fourth collective (#3) is where they parted.
    assert lines[0] == "the ranks parted at collective #3:", explained.stdout
    assert re.search(
        r"rank 0: allreduce 'after' \(#3, 16 B, from .*hangs\.py:\d+ in main\), "
        r"pending",
        lines[1],
    ), lines
    assert re.search(
        r"rank 1: allreduce 'only-rank-1-calls-this' \(#3, 16 B, from .*hangs\.py:"
        r"\d+ in planted_other_collective\), pending",
        lines[2],
    ), lines
    Path(found.group(1)).unlink()


def start_hanging_job(tmp_path: Path, ranks: int) -> tuple[subprocess.Popen[str], Path]:
    """A job whose rank 1 waits for `done` (the others wait for it in an allreduce)."""
    done = tmp_path / "done"
    env = {k: v for k, v in os.environ.items() if k != "RINGPLUG_MPIEXEC"}
    env.update(HANGS_DONE_FILE=str(done), RINGPLUG_STALL_CHECK_SECONDS="60")
    job = subprocess.Popen(
        [*RINGRUN, "-np", str(ranks), sys.executable, HANGS, "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    return job, done


def wait_until_ready(job: subprocess.Popen[str], ranks: int) -> list[str]:
    """Read the job's output until every rank printed "ready" (bounded)."""
    seen, lines = set(), []
    deadline = time.monotonic() + 60
    assert job.stdout is not None
    while len(seen) < ranks:
        assert time.monotonic() < deadline and job.poll() is None, lines
        line = job.stdout.readline()
        lines.append(line)
        found = re.search(r"rank (\d+) ready", line)
        if found:
            seen.add(found.group(1))
    return lines


def test_ringrun_stacks_prints_every_rank_with_ranks_stuck_alike_once(tmp_path):
    job, done = start_hanging_job(tmp_path, 4)
    try:
        wait_until_ready(job, 4)
        asked = subprocess.run(
            [*RINGRUN, "--stacks", str(job.pid)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        done.touch()
        _, stderr = job.communicate(timeout=60)
    assert asked.returncode == 0, asked.stderr
    out = asked.stdout
    assert out.startswith("stacks of 4 ranks, taken just now:"), out
    # Ranks 0, 2 and 3 wait in the same allreduce; rank 1 is elsewhere.
    assert re.search(r"^ranks 0, 2-3 \(sleeping\):$", out, re.M), out
    rank_1 = out[out.index("rank 1 on host") :]
    assert "in planted_wait_for_file   <-- innermost user frame" in rank_1
    # SIGUSR1 went to the wrappers, not to the programs: the job went on and ended well.
    assert job.returncode == 0, stderr


def test_sigusr1_to_ringrun_prints_the_stacks_in_the_jobs_output(tmp_path):
    job, done = start_hanging_job(tmp_path, 2)
    try:
        wait_until_ready(job, 2)
        job.send_signal(signal.SIGUSR1)
        assert job.stderr is not None
        deadline = time.monotonic() + 30
        lines = []
        while not any("in planted_wait_for_file" in line for line in lines):
            assert time.monotonic() < deadline, lines
            lines.append(job.stderr.readline())
    finally:
        done.touch()
        _, rest = job.communicate(timeout=60)
    assert any(line.startswith("ringrun: stacks of 2 ranks, taken just now:") for line in lines)
    assert job.returncode == 0, "".join(lines) + rest


def test_ringrun_stacks_without_a_running_job_says_so():
    result = run_ringrun("--stacks", "999999999")
    assert result.returncode == 1
    assert "no running ringrun with pid 999999999" in result.stderr
