"""``ringrun --dry-run`` prints the launcher command line that would run, for each MPI."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from launch import fake_open_mpi, run_ringrun

VENV_MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def dry_run(*args: str, extra_env: dict[str, str] | None = None) -> list[str]:
    """The dry-run line for ``args``, split back into words."""
    result = run_ringrun("--dry-run", *args, extra_env=extra_env, timeout=30)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    return shlex.split(lines[0])


def follows(words: list[str], *expected: str) -> bool:
    """Whether ``expected`` occurs in ``words`` as consecutive words."""
    n = len(expected)
    return any(tuple(words[i : i + n]) == expected for i in range(len(words) - n + 1))


def test_hydra_line_runs_each_rank_in_the_wrapper_with_rank_prefixes():
    words = dry_run("-np", "2", "python", "train.py", "--lr", "0.1")
    assert words[0] == VENV_MPIEXEC
    assert follows(words, "-n", "2")
    assert "-prepend-rank" in words
    assert follows(words, "-genv", "PYTHONUNBUFFERED", "1")
    assert words[-8:] == [
        sys.executable,
        "-m",
        "ringplug.run.launch.wrapper",
        "--",
        "python",
        "train.py",
        "--lr",
        "0.1",
    ]


def test_hydra_line_translates_hosts_interface_binding_and_variables():
    words = dry_run(
        "-np",
        "4",
        "-H",
        "node1:2,node2:2",
        "--network-interface",
        "eth0",
        "--bind-to",
        "core",
        "-x",
        "FOO=bar baz",
        "python",
        "train.py",
    )
    assert follows(words, "-hosts", "node1:2,node2:2")
    assert follows(words, "-iface", "eth0")
    assert follows(words, "-bind-to", "core")
    # The user's value travels in mpiexec's environment (hydra passes it on), not its argv.
    assert "FOO=<hidden>" in words and "bar baz" not in words and "FOO" not in words
    assert follows(words, "-genv", "NCCL_SOCKET_IFNAME", "eth0")


def test_hydra_ssh_options_go_through_hydras_launcher_variable(tmp_path):
    words = dry_run(
        "-np",
        "2",
        "-H",
        "a:1,b:1",
        "-p",
        "2222",
        "-i",
        str(tmp_path / "key"),
        "--ssh-config-file",
        str(tmp_path / "config"),
        "python",
        "x.py",
    )
    assert words[0] == (
        "HYDRA_LAUNCHER_EXTRA_ARGS=-o BatchMode=yes -o ConnectTimeout=10 "
        f"-F {tmp_path / 'config'} -i {tmp_path / 'key'} -p 2222"
    )
    assert follows(words, "-launcher", "ssh")


def test_remote_hosts_get_ssh_that_never_prompts():
    # A password prompt nobody sees would hang the job; ssh fails at once instead.
    words = dry_run("-np", "2", "-H", "a:1,b:1", "python", "x.py")
    assert words[0] == "HYDRA_LAUNCHER_EXTRA_ARGS=-o BatchMode=yes -o ConnectTimeout=10"


def test_hosts_of_this_machine_need_no_ssh():
    words = dry_run("-np", "2", "-H", "localhost:2", "python", "x.py")
    assert not words[0].startswith("HYDRA_LAUNCHER_EXTRA_ARGS")
    assert "-launcher" not in words


def test_hostfile_becomes_a_host_list(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2:2\n")
    words = dry_run("-np", "4", "--hostfile", str(hostfile), "python", "x.py")
    assert follows(words, "-hosts", "node1:2,node2:2")


def test_rank_count_defaults_to_the_slots_of_the_hosts():
    words = dry_run("-H", "a:2,b:1", "python", "x.py")
    assert follows(words, "-n", "3")


def test_double_dash_separates_ringrun_flags_from_the_command():
    words = dry_run("-np", "2", "--", "python", "-x", "--verbose")
    assert words[-3:] == ["python", "-x", "--verbose"]


def test_open_mpi_line_has_the_flags_open_mpi_needs(tmp_path):
    mpiexec = fake_open_mpi(tmp_path)
    words = dry_run("-np", "2", "python", "x.py", extra_env={"RINGPLUG_MPIEXEC": str(mpiexec)})
    assert words[0] == str(mpiexec)
    assert follows(words, "-np", "2")
    assert "--oversubscribe" in words
    assert "--tag-output" in words
    assert follows(words, "-x", "PYTHONUNBUFFERED=1")
    assert follows(words, "-x", "PATH")


def test_open_mpi_as_root_gets_allow_run_as_root(tmp_path):
    import os

    mpiexec = fake_open_mpi(tmp_path)
    words = dry_run("-np", "2", "python", "x.py", extra_env={"RINGPLUG_MPIEXEC": str(mpiexec)})
    assert ("--allow-run-as-root" in words) == (os.geteuid() == 0)


def test_open_mpi_line_translates_hosts_interfaces_ssh_port_binding_and_variables(tmp_path):
    mpiexec = fake_open_mpi(tmp_path)
    words = dry_run(
        "-np",
        "4",
        "-H",
        "node1:2,node2:2",
        "--network-interface",
        "eth0",
        "--network-interface",
        "ib0",
        "-p",
        "2222",
        "--bind-to",
        "socket",
        "-x",
        "FOO=bar",
        "-x",
        "FORWARD_ME",
        "python",
        "x.py",
        extra_env={"RINGPLUG_MPIEXEC": str(mpiexec), "FORWARD_ME": "1", "NCCL_DEBUG": "INFO"},
    )
    assert follows(words, "-H", "node1:2,node2:2")
    assert follows(words, "--mca", "btl_tcp_if_include", "eth0,ib0")
    assert follows(words, "--mca", "oob_tcp_if_include", "eth0,ib0")
    assert follows(words, "--mca", "plm_rsh_args", "-o BatchMode=yes -o ConnectTimeout=10 -p 2222")
    assert follows(words, "--bind-to", "socket")
    # Open MPI's `-x NAME` exports the value from mpirun's environment, where it travels.
    assert follows(words, "-x", "FOO") and "FOO=<hidden>" in words
    assert not any("bar" in word for word in words)
    assert follows(words, "-x", "FORWARD_ME")
    assert follows(words, "-x", "NCCL_DEBUG")
    assert follows(words, "-x", "NCCL_SOCKET_IFNAME=eth0,ib0")


def test_verbose_prints_the_line_it_runs():
    result = run_ringrun("-np", "1", "--verbose", sys.executable, "-c", "pass", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ringplug.run.launch.wrapper" in result.stderr
    assert "-prepend-rank" in result.stderr


def test_missing_command_is_a_usage_error():
    result = run_ringrun("-np", "2", timeout=30)
    assert result.returncode == 2
    assert "no command given" in result.stderr


def test_timeline_flag_hands_the_ranks_an_absolute_trace_path(tmp_path):
    result = run_ringrun(
        "--dry-run",
        "-np",
        "2",
        "--timeline",
        "trace.json",
        "python",
        "t.py",
        cwd=tmp_path,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.strip())
    assert follows(words, "-genv", "RINGPLUG_TIMELINE", str(tmp_path.resolve() / "trace.json"))
