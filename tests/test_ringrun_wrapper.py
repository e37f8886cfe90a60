"""The per-rank wrapper: exit codes, rank events, output copies, and staying light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ringplug.run.launch.processes import framework_rank_variables, rank_from_environment
from ringplug.run.launch.status import RankStarted, RankStatus, event_line, parse_event
from ringplug.run.launch.wrapper import rank_directory_name

TOKEN = "0123456789abcdef"

WRAPPER = [sys.executable, "-m", "ringplug.run.launch.wrapper", "--"]


def run_wrapper(*command: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
    import os

    return subprocess.run(
        [sys.executable, "-m", "ringplug.run.launch.wrapper", *args, "--", *command],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
        check=False,
    )


def events(stderr: str) -> list[RankStarted | RankStatus]:
    """The events among the wrapper's stderr lines, in order."""
    found = (parse_event(line, TOKEN) for line in stderr.splitlines())
    return [event for event in found if event is not None]


def modules_imported_by_the_wrapper() -> str:
    """The wrapper's ``-X importtime`` log (the child command is a separate interpreter)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *WRAPPER[1:], sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "ringplug.run.launch.status" in result.stderr  # the log covers the wrapper's imports
    return result.stderr


def test_wrapper_does_not_import_mpi4py():
    # MPI initialised in the wrapper would take over the rank's PMI connection.
    assert "mpi4py" not in modules_imported_by_the_wrapper()


def test_wrapper_does_not_import_the_core():
    assert "ringplug.core" not in modules_imported_by_the_wrapper()


def test_exit_code_of_the_command_is_passed_on():
    result = run_wrapper(sys.executable, "-c", "import sys; sys.exit(7)")
    assert result.returncode == 7


def test_death_by_signal_becomes_128_plus_the_signal():
    result = run_wrapper(sys.executable, "-c", "import os; os.kill(os.getpid(), 9)")
    assert result.returncode == 128 + 9


def test_failure_is_reported_with_rank_host_pid_and_code():
    result = run_wrapper(
        sys.executable,
        "-c",
        "import os, sys; print(os.getpid()); sys.exit(3)",
        env={"RINGPLUG_RUN_EVENTS": TOKEN, "PMI_RANK": "4"},
    )
    started, status = events(result.stderr)
    assert started == RankStarted(rank=4, host=status.host, pid=int(result.stdout))
    assert status.rank == 4
    assert status.pid == int(result.stdout)
    assert status.exit_code == 3
    assert status.signal_name is None
    assert status.timestamp > 0
    assert status.describe().startswith("rank 4 on host ")


def test_signal_is_reported_by_name():
    result = run_wrapper(
        sys.executable,
        "-c",
        "import os; os.kill(os.getpid(), 9)",
        env={"RINGPLUG_RUN_EVENTS": TOKEN, "OMPI_COMM_WORLD_RANK": "1"},
    )
    (status,) = [event for event in events(result.stderr) if isinstance(event, RankStatus)]
    assert status.rank == 1
    assert status.signal_name == "SIGKILL"
    assert status.exit_code is None


def test_success_reports_the_start_and_a_clean_exit():
    result = run_wrapper(sys.executable, "-c", "pass", env={"RINGPLUG_RUN_EVENTS": TOKEN})
    started, ended = events(result.stderr)
    assert isinstance(started, RankStarted)
    assert isinstance(ended, RankStatus) and ended.clean and ended.exit_code == 0


def test_no_events_unless_ringrun_asked():
    result = run_wrapper(sys.executable, "-c", "import sys; sys.exit(2)")
    assert result.returncode == 2
    assert "ringrun-event" not in result.stderr


def test_event_line_starts_a_line_of_its_own_after_unfinished_output():
    # The program's last stderr line has no newline; the report must still be one line.
    result = run_wrapper(
        sys.executable,
        "-c",
        "import sys; sys.stderr.write('50%'); sys.stderr.flush(); sys.exit(5)",
        env={"RINGPLUG_RUN_EVENTS": TOKEN},
    )
    lines = result.stderr.splitlines()
    assert lines[0].startswith("ringrun-event:")  # started
    # The exit report goes out before the output is drained (ringrun must hear of the exit
    # even if the launcher kills the wrapper next), so it may come before or after "50%";
    # either way neither is glued to the other.
    assert lines.count("50%") == 1
    rest = [line for line in lines[1:] if line != "50%"]
    assert len(rest) == 1 and parse_event(rest[0], TOKEN).exit_code == 5


def test_event_lines_of_another_job_or_mangled_ones_are_not_events():
    line = event_line(TOKEN, {"event": "exited", "rank": 1}).decode()
    assert parse_event(line, TOKEN) is None  # fields missing
    good = event_line(TOKEN, RankStarted(rank=2, host="h", pid=7).to_event()).decode()
    assert parse_event("[2] " + good, TOKEN) == RankStarted(rank=2, host="h", pid=7)
    assert parse_event(good, "another-token") is None


def test_output_is_copied_per_rank_and_still_printed(tmp_path):
    result = run_wrapper(
        sys.executable,
        "-c",
        "import sys; print('to out'); print('to err', file=sys.stderr)",
        env={"PMI_RANK": "3", "PMI_SIZE": "12"},
        args=("--output-dir", str(tmp_path)),
    )
    assert result.stdout == "to out\n"
    assert result.stderr == "to err\n"
    assert (tmp_path / "rank.03" / "stdout").read_text() == "to out\n"
    assert (tmp_path / "rank.03" / "stderr").read_text() == "to err\n"


def test_missing_command_exits_127_and_reports_it_without_a_start():
    result = run_wrapper("/nonexistent/program", env={"RINGPLUG_RUN_EVENTS": TOKEN})
    assert result.returncode == 127
    assert "cannot start" in result.stderr
    (status,) = events(result.stderr)
    assert status.exit_code == 127


@pytest.mark.parametrize(
    ("environ", "rank"),
    [
        ({"PMI_RANK": "2"}, 2),
        ({"OMPI_COMM_WORLD_RANK": "5"}, 5),
        ({"PMIX_RANK": "1"}, 1),
        ({"SLURM_PROCID": "7"}, 7),
        ({}, None),
    ],
)
def test_rank_comes_from_whichever_launcher_started_it(environ, rank):
    assert rank_from_environment(environ) == rank


def test_rank_directories_sort_numerically():
    names = [rank_directory_name(rank, size=12) for rank in range(12)]
    assert names == sorted(names)
    assert names[0] == "rank.00"


def test_the_rank_that_ended_first_is_named_even_when_a_consequence_is_reported_first():
    from ringplug.run.launch.job import root_cause

    killed = RankStatus(2, "node-b", 41, None, "SIGKILL", timestamp=1000.0)
    crashed = RankStatus(0, "node-a", 40, None, "SIGSEGV", timestamp=1000.4)  # its peer died
    late = RankStatus(1, "node-c", 42, 1, None, timestamp=990.0)  # a skewed clock, 5 s later
    # The crash on this host is reported 0.3 s before the kill on the other host.
    assert root_cause([crashed, killed], [10.0, 10.3]) is killed
    # A report long after the first is a consequence, whatever its host's clock says.
    assert root_cause([crashed, late], [10.0, 15.0]) is crashed
    assert root_cause([], []) is None


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (
            {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1"},
            {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1"},
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            },
            {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"},
        ),
        (
            {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"},
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0"},
        ),
        ({"PMI_RANK": "2", "PMI_SIZE": "4"}, {"RANK": "2", "WORLD_SIZE": "4"}),  # no local rank
        ({"PMI_RANK": "2"}, {}),  # no size: not a job ringplug can describe
        ({}, {}),
    ],
)
def test_rank_variables_for_frameworks_come_from_the_launchers_own(environ, expected):
    variables = framework_rank_variables(environ)
    assert variables == expected
    # With GROUP_RANK and LOCAL_WORLD_SIZE too, Lightning would take it for a torchrun job.
    assert not {"GROUP_RANK", "LOCAL_WORLD_SIZE"} & set(variables)


def test_the_program_sees_its_rank_variables_from_its_first_line():
    code = (
        "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'])"
    )
    result = run_wrapper(
        sys.executable, "-c", code, env={"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "2", "1"]
