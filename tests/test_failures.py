"""When one rank dies, every rank stops within the bound and the rank is named.

A rank that raises, a rank that is SIGKILLed, and a rank that never arrives while the
others wait inside a collective. No test waits on a timer: each job ends by itself, and
`subprocess` bounds are only there so that a regression fails instead of hanging.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launch import processes_matching, run_ringrun, unique_marker

pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "failures.py")
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
# The bound is 10 s from the failure to every rank stopped; the job also needs a
# couple of seconds to start, so the whole job gets 20 s before it counts as hung.
JOB_BOUND_S = 20


def run_scenario(scenario: str, ranks: int = 2, env: dict[str, str] | None = None):
    marker = unique_marker(scenario)
    result = run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        WORKER,
        scenario,
        marker,
        extra_env=env,
        timeout=JOB_BOUND_S,
    )
    return result, marker


@pytest.mark.parametrize("ranks", [2, 3])
def test_an_exception_on_one_rank_stops_every_rank_and_names_it(ranks):
    result, marker = run_scenario("exception", ranks)
    assert result.returncode != 0
    assert "boom: rank 1 failed on purpose" in result.stdout + result.stderr
    assert "ringrun: rank 1 " in result.stderr
    assert "exited with code 1" in result.stderr
    assert processes_matching(marker) == []


def test_the_traceback_survives_torch_distributeds_excepthook():
    pytest.importorskip("torch")
    result, marker = run_scenario("exception-after-gloo", 2)
    assert result.returncode != 0
    assert "RuntimeError: boom: rank 1 failed on purpose" in result.stdout + result.stderr
    assert "ringrun: rank 1 " in result.stderr
    assert processes_matching(marker) == []


def test_a_killed_rank_stops_every_rank_and_is_named_with_its_signal():
    result, marker = run_scenario("kill", 3)
    assert result.returncode != 0
    assert "ringrun: rank 1 " in result.stderr
    assert "SIGKILL" in result.stderr
    assert processes_matching(marker) == []


def test_a_rank_that_never_arrives_aborts_the_job_after_the_timeout_naming_it():
    result, marker = run_scenario("absent", 3, env={"RINGPLUG_TIMEOUT": "2"})
    output = result.stdout + result.stderr
    assert result.returncode != 0
    # Ranks 0 and 2 both wait in the same allreduce and both name rank 1 as missing.
    for waiting in (0, 2):
        assert f"rank {waiting} waited 2 s in allreduce 'stuck' for rank(s) 1" in output
    assert "which never submitted it" in output
    assert "RINGPLUG_TIMEOUT=2" in output
    assert processes_matching(marker) == []


def test_the_cause_reaches_ringrun_when_the_program_captures_its_own_stderr():
    # pytest's file-descriptor capture keeps what a rank prints; the wrapper relays the
    # fault the rank leaves it, so the summary still says who waited for whom.
    result, marker = run_scenario("absent-captured", 2, env={"RINGPLUG_TIMEOUT": "2"})
    assert result.returncode != 0
    assert "rank 0 said: rank 0 waited 2 s in allreduce 'stuck' for rank(s) 1" in result.stderr
    assert result.stderr.count("said:") == 1  # the rank's own copy never arrived
    assert processes_matching(marker) == []


def where_they_are(marker: str) -> str:
    """What each process of a job that overran its bound is doing: its state, and its
    Python stacks (taken through the stack handler every rank installs, in a temporary
    folder of its own under plain mpiexec), for the failure."""
    from ringplug.forensics import stacks

    lines = []
    for line in processes_matching(marker):
        pid = int(line.split()[0])
        handlers = list(Path(tempfile.gettempdir()).glob(f"ringplug-stacks-*/{pid}.stacks"))
        folder = handlers[0].parent if handlers else None
        report = stacks.outside(pid, folder, children=False)
        lines += [line, *stacks.report_lines(f"pid {pid}", report)]
    return "\n".join(lines) or "no process of the job is left"


def test_an_exception_under_plain_mpiexec_aborts_instead_of_hanging():
    # Without ringrun, hydra alone would leave the other rank waiting forever; ringplug's
    # exception hook aborts the MPI job.
    marker = unique_marker("plain-mpiexec")
    job = subprocess.Popen(
        [MPIEXEC, "-n", "2", sys.executable, WORKER, "exception", marker],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stdout, stderr = job.communicate(timeout=JOB_BOUND_S)
    except subprocess.TimeoutExpired:
        found = where_they_are(marker)
        job.kill()
        stdout, stderr = job.communicate(timeout=10)
        for line in processes_matching(marker):  # no rank outlives the test
            subprocess.run(["kill", "-9", line.split()[0]], check=False, timeout=10)
        pytest.fail(
            f"the job was not over within {JOB_BOUND_S} s; where its processes were:\n{found}"
            f"\n--- stdout:\n{stdout}\n--- stderr:\n{stderr}"
        )
    result = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert (
        "FATAL: uncaught RuntimeError on rank 1; ending this rank so that the launcher stops "
        "all 2 ranks" in output
    )
    assert processes_matching(marker) == []
