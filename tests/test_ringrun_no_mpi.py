"""Without any MPI launcher, ringrun says what to install, but still runs a single rank."""

from __future__ import annotations

import pytest

from launch import python_without_mpi, run_ringrun
from ringplug.run.launch.mpi import JobSpec, LauncherError, build_plan, find_launcher_path


def test_no_launcher_is_found_in_an_empty_environment(tmp_path):
    assert find_launcher_path({"PATH": str(tmp_path)}, python=str(tmp_path / "python")) is None


def test_launcher_override_must_be_an_executable(tmp_path):
    with pytest.raises(LauncherError, match="RINGPLUG_MPIEXEC"):
        find_launcher_path({"RINGPLUG_MPIEXEC": str(tmp_path / "nope"), "PATH": ""})


def test_several_ranks_without_a_launcher_fail_with_what_to_install(tmp_path):
    python, env = python_without_mpi(tmp_path)
    result = run_ringrun(
        "-np",
        "2",
        "python",
        "-c",
        "pass",
        env=env,
        ringrun=[str(python), "-m", "ringplug.run.cli"],
        timeout=30,
    )
    assert result.returncode == 2
    assert "no MPI launcher found" in result.stderr
    assert "pip install 'ringplug[mpich]'" in result.stderr
    assert "MPI module" in result.stderr


def test_remote_hosts_without_a_launcher_fail_even_for_one_rank():
    with pytest.raises(LauncherError, match="no MPI launcher"):
        from ringplug.run.hosts.spec import Host

        build_plan(JobSpec(np=1, command=["true"], hosts=[Host("a", 1)]), launcher=None)


def test_one_rank_without_a_launcher_runs_the_command_directly(tmp_path):
    python, env = python_without_mpi(tmp_path)
    result = run_ringrun(
        "-np",
        "1",
        str(python),
        "-c",
        "import sys; print('alone'); sys.exit(5)",
        env=env,
        ringrun=[str(python), "-m", "ringplug.run.cli"],
        timeout=30,
    )
    assert result.stdout == "alone\n"
    assert result.returncode == 5
    assert "rank 0 on host" in result.stderr
    assert "exited with code 5" in result.stderr


def test_dry_run_without_a_launcher_shows_the_direct_command(tmp_path):
    python, env = python_without_mpi(tmp_path)
    result = run_ringrun(
        "-np",
        "1",
        "--dry-run",
        "train.py",
        env=env,
        ringrun=[str(python), "-m", "ringplug.run.cli"],
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("PYTHONUNBUFFERED=1 ")
    assert "-m ringplug.run.launch.wrapper -- train.py" in result.stdout
