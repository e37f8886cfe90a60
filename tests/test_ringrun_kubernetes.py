"""ringrun in a Kubernetes MPIJob: the hostfile the MPI Operator mounts gives the hosts.

The MPI Operator (v2beta1) starts ringrun in a launcher pod with no -H, and names the
workers in /etc/mpi/hostfile through the variable of the MPIJob's MPI implementation. These
tests fake that environment: the variable, a hostfile in the operator's format, and (where
no MPI is needed) a fake Open MPI.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from launch import fake_open_mpi, run_ringrun
from ringplug.run.hosts.spec import LAUNCHER_HOSTFILE_VARIABLES, Host, launcher_hostfile

WORKERS = ["pi-worker-0.pi.default.svc", "pi-worker-1.pi.default.svc"]


def operator_hostfile(directory: Path, lines: list[str]) -> Path:
    path = directory / "hostfile"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def dry_run_words(stdout: str) -> list[str]:
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    return shlex.split(lines[0])


def flag_value(words: list[str], *spellings: str) -> str:
    """The value after the flag, in whichever launcher's spelling the line has."""
    (index,) = [i for i, word in enumerate(words) if word in spellings]
    return words[index + 1]


def test_open_mpi_mpijob_hosts_and_ssh_retries_reach_the_launcher_line(tmp_path):
    # What the operator sets for mpiImplementation: OpenMPI, with slotsPerWorker: 2.
    hostfile = operator_hostfile(tmp_path, [f"{name} slots=2" for name in WORKERS])
    env = {
        "RINGPLUG_MPIEXEC": str(fake_open_mpi(tmp_path)),
        "OMPI_MCA_orte_default_hostfile": str(hostfile),
        "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
        "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
        "K_MPI_JOB_ROLE": "launcher",
    }
    result = run_ringrun(
        "--dry-run", "--no-preflight", "python", "train.py", extra_env=env, timeout=30
    )
    assert result.returncode == 0, result.stderr
    words = dry_run_words(result.stdout)
    assert words[words.index("-np") + 1] == "4"  # the slots of the hostfile
    assert words[words.index("-H") + 1] == ",".join(f"{name}:2" for name in WORKERS)
    # ringrun's --mca plm_rsh_args replaces the variable: the operator's words stay in it.
    rsh = words[words.index("plm_rsh_args") + 1]
    assert rsh.startswith("-o ConnectionAttempts=10 -o BatchMode=yes")
    assert f"hosts from OMPI_MCA_orte_default_hostfile={hostfile}: " in result.stderr


def test_mpich_mpijob_hostfile_is_checked_by_the_preflight_before_the_dry_run_line(tmp_path):
    # mpiImplementation: MPICH writes host:slots lines; one worker's name does not resolve.
    hostfile = operator_hostfile(tmp_path, ["localhost:1", "no-such-worker.invalid:1"])
    result = run_ringrun(
        "--dry-run", "python", "x.py", extra_env={"HYDRA_HOST_FILE": str(hostfile)}, timeout=90
    )
    assert result.returncode == 0, result.stderr
    words = dry_run_words(result.stdout)
    assert flag_value(words, "-n", "-np") == "2"
    assert flag_value(words, "-hosts", "-H") == "localhost:1,no-such-worker.invalid:1"
    assert f"hosts from HYDRA_HOST_FILE={hostfile}: localhost:1,no-such-worker.invalid:1" in (
        result.stderr
    )
    assert "host no-such-worker.invalid" in result.stderr
    assert "unknown host name" in result.stderr


def test_a_real_run_names_the_mpijob_worker_that_cannot_be_reached(tmp_path):
    hostfile = operator_hostfile(tmp_path, ["localhost slots=1", "no-such-worker.invalid slots=1"])
    marker = tmp_path / "ran"
    result = run_ringrun(
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
        extra_env={"OMPI_MCA_orte_default_hostfile": str(hostfile)},
        timeout=90,
    )
    assert result.returncode == 255
    assert (
        "cannot start the job: host no-such-worker.invalid (rank 1): unknown host name"
        in result.stderr
    )
    assert not marker.exists()


def test_check_in_an_intel_mpi_mpijob_checks_the_workers(tmp_path):
    hostfile = operator_hostfile(tmp_path, ["no-such-worker.invalid:1"])
    result = run_ringrun("--check", extra_env={"I_MPI_HYDRA_HOST_FILE": str(hostfile)}, timeout=90)
    assert result.returncode == 1
    assert "host no-such-worker.invalid: unknown host name" in result.stdout
    assert f"hosts from I_MPI_HYDRA_HOST_FILE={hostfile}" in result.stderr


def test_hosts_on_the_command_line_win_over_the_launchers_hostfile(tmp_path):
    hostfile = operator_hostfile(tmp_path, ["no-such-worker.invalid:4"])
    result = run_ringrun(
        "--dry-run",
        "-H",
        "localhost:2",
        "python",
        "x.py",
        extra_env={"HYDRA_HOST_FILE": str(hostfile)},
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert flag_value(dry_run_words(result.stdout), "-hosts", "-H") == "localhost:2"
    assert "no-such-worker" not in result.stdout + result.stderr


def test_a_hostfile_passed_to_the_launcher_in_mpi_args_is_left_to_it(tmp_path):
    hostfile = operator_hostfile(tmp_path, ["no-such-worker.invalid:4"])
    result = run_ringrun(
        "--dry-run",
        "-np",
        "2",
        f"--mpi-args=-f {hostfile}",
        "python",
        "x.py",
        extra_env={"HYDRA_HOST_FILE": str(hostfile)},
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert not {"-hosts", "-H"} & set(dry_run_words(result.stdout))


def test_a_hostfile_variable_naming_a_missing_file_is_a_usage_error(tmp_path):
    missing = tmp_path / "etc-mpi" / "hostfile"
    result = run_ringrun(
        "-np", "2", "python", "x.py", extra_env={"HYDRA_HOST_FILE": str(missing)}, timeout=30
    )
    assert result.returncode == 2
    assert f"the hostfile HYDRA_HOST_FILE names, {missing} does not exist" in result.stderr
    assert "Give the hosts with -H or --hostfile, or unset HYDRA_HOST_FILE" in result.stderr


@pytest.mark.parametrize("name", LAUNCHER_HOSTFILE_VARIABLES)
def test_each_implementations_variable_is_read(name, tmp_path):
    assert launcher_hostfile({name: "/etc/mpi/hostfile"}) == (name, "/etc/mpi/hostfile")


def test_no_variable_or_an_empty_one_means_no_hostfile():
    assert launcher_hostfile({}) is None
    assert launcher_hostfile({"HYDRA_HOST_FILE": " "}) is None


def test_operator_hostfile_formats_both_parse(tmp_path):
    from ringplug.run.hosts.spec import parse_hostfile

    open_mpi = operator_hostfile(tmp_path, [f"{name} slots=2" for name in WORKERS])
    assert parse_hostfile(open_mpi) == [Host(name, 2) for name in WORKERS]
    hydra = tmp_path / "hydra"
    hydra.mkdir()
    assert parse_hostfile(operator_hostfile(hydra, [f"{name}:3" for name in WORKERS])) == [
        Host(name, 3) for name in WORKERS
    ]
