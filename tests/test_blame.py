"""The rank whose failure caused the others is the one ringrun names, with its own code.

Real 2- and 3-rank jobs (tests/workers/blame.py) whose ranks end in the orders that once
blamed the wrong rank, and the root-cause rule itself on reports in every arrival order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launch import processes_matching, run_ringrun, unique_marker

WORKER = str(Path(__file__).parent / "workers" / "blame.py")
FAST = {"RINGPLUG_TIMEOUT": "10", "RINGPLUG_STALL_CHECK_SECONDS": "5"}


def run_scenario(scenario: str, ranks: int):
    marker = unique_marker(scenario)
    result = run_ringrun(
        "-np", str(ranks), sys.executable, WORKER, scenario, marker, extra_env=FAST, timeout=90
    )
    assert processes_matching(marker) == [], "ranks were left running"
    return result, result.stdout + result.stderr


def verdict(stderr: str) -> str:
    """ringrun's first line about how the job ended."""
    lines = [
        line
        for line in stderr.splitlines()
        if line.startswith("ringrun: ")
        and "flight records" not in line
        and not line.startswith("ringrun: where rank")
    ]
    assert lines, stderr
    return lines[0]


@pytest.mark.multirank
def test_sys_exit_while_the_others_compute_ends_the_job_with_that_code_at_once():
    result, output = run_scenario("exit-while-computing", 2)
    assert result.returncode == 3, output
    assert verdict(result.stderr).startswith("ringrun: rank 0 on host"), output
    assert "exited with code 3" in verdict(result.stderr)
    assert "stopped in the teardown" not in output
    # The job ended when rank 0 left, not when the others finished computing.
    assert "computed for" not in output


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", ["caught", "caught-late"])
def test_an_exception_caught_around_the_loop_blames_the_rank_that_raised_it(scenario):
    result, output = run_scenario(scenario, 2)
    assert result.returncode == 1, output
    assert "rank 1 caught ValueError: bad batch 3 on rank 1 (planted)" in output
    assert verdict(result.stderr).startswith("ringrun: rank 1 "), output
    # Rank 0's error, caught by the program, still says whom it points to.
    cause = "PeerLeftError on rank 0 (caused by rank 1)"
    said = f"{cause}; the program caught it and exited with code 1"
    assert f"ringplug[0] ERROR: {said}" in output
    assert f"ringrun:   rank 0 said: {said}" in result.stderr
    if scenario == "caught":
        assert "rank 1 on host" in verdict(result.stderr)
        assert "exited with code 1" in verdict(result.stderr)


@pytest.mark.multirank
def test_a_lightning_fit_caught_around_fit_blames_the_rank_whose_step_raised():
    result, output = run_scenario("caught-lightning", 2)
    assert result.returncode == 1, output
    assert "rank 1 caught ValueError: bad batch 3 on rank 1 (planted)" in output
    assert verdict(result.stderr).startswith("ringrun: rank 1 "), output
    assert "rank 0 said: PeerLeftError on rank 0 (caused by rank 1)" in result.stderr


@pytest.mark.multirank
def test_a_killed_rank_is_blamed_before_a_peer_that_raised_an_error_of_its_own():
    result, output = run_scenario("kill-then-raise", 3)
    assert "uncaught ConnectionResetError on rank 2" in output  # it did report first
    assert result.returncode == 137, output
    line = verdict(result.stderr)
    assert line.startswith("ringrun: rank 1 on host") and "killed by signal SIGKILL" in line


def statuses():
    from ringplug.run.launch.status import RankFault, RankStatus

    raised = RankFault(2, (), "uncaught ConnectionResetError on rank 2", timestamp=100.2)
    died = RankStatus(2, "h", 12, 1, None, timestamp=100.3)
    return RankStatus, raised, died


@pytest.mark.parametrize("killed_first", [True, False])
def test_root_cause_a_rank_killed_from_outside_comes_before_a_fault_naming_nobody(killed_first):
    from ringplug.run.launch.job import find_root_cause

    RankStatus, raised, died = statuses()
    killed = RankStatus(1, "h", 11, None, "SIGKILL", timestamp=100.0)
    # Whichever report arrived first (under load the dead rank's wrapper is late).
    failures = [killed, died] if killed_first else [died, killed]
    root = find_root_cause(failures, [1.0, 1.5], [raised], [])
    assert root.rank == 1 and root.status is killed
    assert root.exit_code == 137


def test_root_cause_a_rank_stopped_in_the_teardown_or_killed_long_after_is_not_blamed():
    from ringplug.run.launch.job import find_root_cause

    RankStatus, raised, died = statuses()
    for late in (
        RankStatus(1, "h", 11, None, "SIGTERM", timestamp=100.1),  # the teardown's signal
        RankStatus(1, "h", 11, None, "SIGABRT", timestamp=110.0),  # an abort after the fault
    ):
        root = find_root_cause([died, late], [1.0, 1.5], [raised], [])
        assert root.rank == 2 and root.fault is raised and root.exit_code == 1


def test_the_culprits_of_an_error_are_found_along_its_causes():
    from ringplug.core.errors import PeerLeftError
    from ringplug.core.runtime import _culprits

    peer = PeerLeftError("rank 1 left the job", caused_by=(1,))
    try:
        try:
            raise peer
        except PeerLeftError as error:
            raise RuntimeError("training failed") from error
    except RuntimeError as wrapped:
        outer = wrapped
    assert _culprits(outer) == (1,)
    try:
        try:
            raise peer
        except PeerLeftError:
            raise KeyError("while handling it")  # noqa: B904 - an implicit context
    except KeyError as implicit:
        assert _culprits(implicit) == (1,)
    assert _culprits(ValueError("own")) == ()
    assert _culprits(None) == ()
