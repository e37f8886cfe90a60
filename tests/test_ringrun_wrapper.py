"""The per-rank wrapper: exit codes, failure reports, output copies, and staying light."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ringplug.run.status import read_statuses
from ringplug.run.wrapper import rank_directory_name, rank_from_environment

WRAPPER = [sys.executable, "-m", "ringplug.run.wrapper", "--"]


def run_wrapper(*command: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
    import os

    return subprocess.run(
        [sys.executable, "-m", "ringplug.run.wrapper", *args, "--", *command],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
        check=False,
    )


def modules_imported_by_the_wrapper() -> str:
    """The wrapper's ``-X importtime`` log (the child command is a separate interpreter)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *WRAPPER[1:], sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "ringplug.run.status" in result.stderr  # the log covers the wrapper's imports
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


def test_failure_is_reported_with_rank_host_pid_and_code(tmp_path):
    result = run_wrapper(
        sys.executable,
        "-c",
        "import os, sys; print(os.getpid()); sys.exit(3)",
        env={"RINGPLUG_RUN_STATUS_DIR": str(tmp_path), "PMI_RANK": "4"},
    )
    (status,) = read_statuses(tmp_path)
    assert status.rank == 4
    assert status.pid == int(result.stdout)
    assert status.exit_code == 3
    assert status.signal_name is None
    assert status.timestamp > 0
    assert status.describe().startswith("rank 4 on host ")


def test_signal_is_reported_by_name(tmp_path):
    run_wrapper(
        sys.executable,
        "-c",
        "import os; os.kill(os.getpid(), 9)",
        env={"RINGPLUG_RUN_STATUS_DIR": str(tmp_path), "OMPI_COMM_WORLD_RANK": "1"},
    )
    (status_file,) = tmp_path.glob("*.json")
    report = json.loads(status_file.read_text())
    assert report["rank"] == 1
    assert report["signal_name"] == "SIGKILL"
    assert report["exit_code"] is None


def test_success_leaves_no_report(tmp_path):
    run_wrapper(sys.executable, "-c", "pass", env={"RINGPLUG_RUN_STATUS_DIR": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []


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


def test_missing_command_exits_127_and_reports_it(tmp_path):
    result = run_wrapper("/nonexistent/program", env={"RINGPLUG_RUN_STATUS_DIR": str(tmp_path)})
    assert result.returncode == 127
    assert "cannot start" in result.stderr
    assert read_statuses(tmp_path)[0].exit_code == 127


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
