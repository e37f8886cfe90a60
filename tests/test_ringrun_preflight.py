"""The pieces of ringrun's multi-host support that need no second host.

What ssh's complaints mean, what the probe answers, and how per-host interface choices
become launcher command lines. The same behaviour across real hosts is in
``test_multihost.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun
from ringplug.run.checks.check import CheckContext, build_report, format_report
from ringplug.run.checks.preflight import local_host_names, run_preflight
from ringplug.run.hosts.netinfo import Interface, candidate_interfaces, local_interfaces
from ringplug.run.hosts.probe import LINE_PREFIX
from ringplug.run.hosts.spec import Host
from ringplug.run.hosts.ssh import LaunchDiagnosis, SshOptions, diagnose
from ringplug.run.launch.mpi import (
    HYDRA,
    OPEN_MPI,
    JobSpec,
    MpiLauncher,
    NetworkChoice,
    build_plan,
    rank_segments,
)
from ringplug.run.settings import RunSettings, SettingsError

PYTHON = "/venv/bin/python"


# ------------------------------------------------------------------ what ssh's output means
@pytest.mark.parametrize(
    ("output", "returncode", "reason"),
    [
        (["ssh: connect to host n2 port 22: Connection refused"], 255, "ssh refused"),
        (["ssh: connect to host n2 port 22: No route to host"], 255, "no route"),
        (["ssh: connect to host n2 port 22: Connection timed out"], 255, "no route"),
        ([], None, "no answer"),
        (
            ["ssh: Could not resolve hostname n2: Name or service not known"],
            255,
            "unknown host name",
        ),
        (
            [
                "No ED25519 host key is known for n2 and you have requested strict checking.",
                "Host key verification failed.",
            ],
            255,
            "host key",
        ),
        (
            [
                "@@@@@@@",
                "Host key for n2 has changed and you have requested strict checking.",
                "Host key verification failed.",
            ],
            255,
            "host key changed",
        ),
        (["root@n2: Permission denied (publickey)."], 255, "ssh login refused"),
        ([f"bash: line 1: {PYTHON}: No such file or directory"], 127, "wrong Python"),
        ([f"env: '{PYTHON}': No such file or directory"], 127, "wrong Python"),
        ([f"{PYTHON}: No module named ringplug.run.hosts.probe"], 1, "wrong Python"),
        (["something nobody expected"], 3, "ssh failed"),
    ],
)
def test_ssh_failures_get_a_reason_and_a_fix_naming_the_host(output, returncode, reason):
    problem = diagnose("n2", output, returncode, PYTHON)
    assert problem.host == "n2"
    assert problem.reason == reason
    assert "n2" in problem.fix or PYTHON in problem.fix or "PORT" in problem.fix


def test_a_login_that_asks_for_a_password_is_told_to_install_a_key():
    problem = diagnose("n2", ["root@n2: Permission denied (publickey,password)."], 255, PYTHON)
    assert "ssh-copy-id n2" in problem.fix
    assert "publickey,password" in problem.detail


def test_launcher_output_is_read_for_the_hosts_it_names():
    diagnosis = LaunchDiagnosis()
    for line in [
        "[0] hello",
        "ssh: connect to host n3 port 2222: Connection refused",
        "[mpiexec@n1] ui_cmd_cb (...): Launch proxy failed.",
        "ssh: connect to host n3 port 2222: Connection refused",
        "bash: line 1: /venv/bin/hydra_pmi_proxy: No such file or directory",
    ]:
        diagnosis.feed(line)
    assert [(p.host, p.reason) for p in diagnosis.problems] == [("n3", "ssh refused")]
    assert "port 2222" in diagnosis.problems[0].detail
    assert diagnosis.unnamed == [
        "bash: line 1: /venv/bin/hydra_pmi_proxy: No such file or directory"
    ]


def test_ssh_never_prompts_and_carries_the_users_options():
    options = SshOptions(port=2222, identity_file="/k", config_file="/c", connect_timeout_s=7)
    assert options.command("n2", "true") == [
        "ssh",
        "-T",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=7",
        "-F",
        "/c",
        "-i",
        "/k",
        "-p",
        "2222",
        "n2",
        "true",
    ]


# ------------------------------------------------------------------ interfaces and the probe
def test_this_machines_loopback_is_listed_and_never_a_candidate():
    interfaces = local_interfaces()
    loopback = [interface for interface in interfaces if interface.address == "127.0.0.1"]
    assert loopback and loopback[0].loopback
    assert all(not interface.loopback for interface in candidate_interfaces(interfaces))


def test_candidates_skip_down_and_link_local_addresses_and_put_physical_links_first():
    interfaces = [
        Interface("docker0", "172.17.0.1", 16, virtual=True),
        Interface("eth0", "10.0.0.1", 24, speed_mbps=1000),
        Interface("eth1", "169.254.3.4", 16),
        Interface("eth2", "10.1.0.1", 24, up=False),
        Interface("ib0", "10.2.0.1", 24, speed_mbps=100000),
    ]
    assert [i.name for i in candidate_interfaces(interfaces)] == ["ib0", "eth0", "docker0"]
    assert interfaces[1].network == "10.0.0.0/24"


def test_the_probe_answers_with_facts_and_finds_its_own_token():
    probe = subprocess.Popen(
        [sys.executable, "-m", "ringplug.run.hosts.probe", "--need", sys.executable],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        hello = json.loads(probe.stdout.readline().removeprefix(LINE_PREFIX))
        assert hello["kind"] == "hello"
        assert hello["facts"]["executable"] == sys.executable
        assert hello["facts"]["versions"]["ringplug"]
        assert hello["facts"]["files"] == {sys.executable: True}
        targets = [
            {"key": "self", "address": "127.0.0.1", "port": hello["port"]},
            {"key": "closed", "address": "127.0.0.1", "port": 1},
        ]
        probe.stdin.write(json.dumps({"kind": "connect", "targets": targets}) + "\n")
        probe.stdin.flush()
        answer = json.loads(probe.stdout.readline().removeprefix(LINE_PREFIX))
    finally:
        probe.stdin.close()
        probe.wait(10)
    mine, closed = answer["results"]
    assert mine["ok"] and mine["token"] == hello["token"]
    assert not closed["ok"] and closed["error"] == "Connection refused"
    assert probe.returncode == 0


def test_names_and_addresses_of_this_machine_are_local():
    names = local_host_names([Host("localhost"), Host("127.0.0.1"), Host("192.0.2.200")])
    assert names == {"localhost", "127.0.0.1"}


def test_a_job_on_this_machine_alone_needs_no_ssh_and_no_network():
    preflight = run_preflight([Host("localhost", 2)], SshOptions(), sys.executable, 30)
    assert preflight.problems == []
    assert preflight.hosts[0].local and preflight.hosts[0].facts["python"]
    assert preflight.network_choice() is None


def test_check_with_this_machine_as_the_host_is_ready(tmp_path):
    context = CheckContext(hosts=[Host("localhost", 2)])
    text = format_report(build_report(context), verdict=True)
    assert re.search(r"\nHosts\n  localhost( \(\S+\))? +this machine, Python", text)
    assert "one machine: its ranks talk over shared memory" in text
    assert "Verdict: READY" in text


def test_check_with_an_unknown_host_is_not_ready_and_exits_1():
    result = run_ringrun("--check", "-H", "no-such-host.invalid", timeout=90)
    assert result.returncode == 1
    assert "host no-such-host.invalid: unknown host name" in result.stdout
    assert "fix: give the address of no-such-host.invalid in -H" in result.stdout


def test_ssh_and_preflight_settings_are_config_file_keys():
    settings = RunSettings.from_mapping(
        {
            "ssh_identity_file": "~/.ssh/k",
            "ssh_config_file": "c.conf",
            "preflight": False,
            "start_timeout": 0,
        },
        source="launch.yaml",
    )
    assert (settings.ssh_identity_file, settings.ssh_config_file) == ("~/.ssh/k", "c.conf")
    assert settings.preflight is False and settings.effective_start_timeout is None
    with pytest.raises(SettingsError, match="preflight must be true or false"):
        RunSettings.from_mapping({"preflight": "no"}, source="launch.yaml")


# ------------------------------------------------------------------ choices on the command line
HYDRA_LAUNCHER = MpiLauncher("/venv/bin/mpiexec", HYDRA, "MPICH hydra 5.0.2")
OPEN_MPI_LAUNCHER = MpiLauncher("/usr/bin/mpirun", OPEN_MPI, "mpirun (Open MPI) 5.0.3")
DIFFERENT_NAMES = NetworkChoice(
    per_host={"a": ["enp6s0"], "b": ["eth1", "ib0"]},
    launcher_interface="enp6s0",
    subnets=["10.0.0.0/24", "10.1.0.0/24"],
)


def spec(**changes) -> JobSpec:
    values = {
        "np": 3,
        "command": ["python", "t.py"],
        "hosts": [Host("a", 2), Host("b", 1)],
        "network": DIFFERENT_NAMES,
    }
    values.update(changes)
    return JobSpec(**values)


def test_hosts_with_different_interface_names_become_one_mpmd_part_each():
    words = build_plan(spec(), HYDRA_LAUNCHER, environ={}, python=PYTHON).argv
    first, second = " ".join(words).split(" : ")
    assert "-iface enp6s0" in first and first.count("-iface") == 1
    assert "-n 2 -env FI_TCP_IFACE enp6s0 -env GLOO_SOCKET_IFNAME enp6s0" in first
    assert "-env NCCL_SOCKET_IFNAME =enp6s0 -env UCX_NET_DEVICES enp6s0" in first
    assert second.startswith("-n 1 -env FI_TCP_IFACE eth1 -env GLOO_SOCKET_IFNAME eth1,ib0")
    assert "-env NCCL_SOCKET_IFNAME =eth1,ib0 -env UCX_NET_DEVICES eth1,ib0" in second
    assert second.endswith(f"{PYTHON} -m ringplug.run.launch.wrapper -- python t.py")


def test_hosts_with_the_same_names_get_them_once_for_the_whole_job():
    same = NetworkChoice(per_host={"a": ["eth0"], "b": ["eth0"]}, launcher_interface="eth0")
    words = build_plan(spec(network=same), HYDRA_LAUNCHER, environ={}, python=PYTHON).argv
    assert ":" not in words
    assert words[1:3] == ["-n", "3"]
    assert " -genv NCCL_SOCKET_IFNAME =eth0 " in " ".join(words)


def test_wrapping_placement_gives_each_run_of_ranks_its_hosts_values():
    segments = rank_segments(spec(np=5), {"a": {"X": "1"}, "b": {"X": "2"}})
    assert segments == [(2, {"X": "1"}), (1, {"X": "2"}), (2, {"X": "1"})]


def test_what_the_user_set_is_not_overridden():
    words = build_plan(
        spec(env={"NCCL_SOCKET_IFNAME": "ib"}),
        HYDRA_LAUNCHER,
        environ={"UCX_NET_DEVICES": "mlx5_0:1"},
        python=PYTHON,
    ).argv
    line = " ".join(words)
    assert "=enp6s0" not in line and "UCX_NET_DEVICES enp6s0" not in line
    assert "-genv NCCL_SOCKET_IFNAME ib" in line
    assert "-env GLOO_SOCKET_IFNAME enp6s0" in line


def test_hosts_with_infiniband_keep_ucxs_own_device_choice():
    rdma = NetworkChoice(per_host=DIFFERENT_NAMES.per_host, rdma_hosts=frozenset({"b"}))
    line = " ".join(build_plan(spec(network=rdma), HYDRA_LAUNCHER, environ={}, python=PYTHON).argv)
    first, second = line.split(" : ")
    assert "UCX_NET_DEVICES" in first and "UCX_NET_DEVICES" not in second


def test_open_mpi_gets_subnets_and_per_host_variables():
    words = build_plan(spec(), OPEN_MPI_LAUNCHER, environ={}, python=PYTHON, is_root=False).argv
    line = " ".join(words)
    assert "--mca btl_tcp_if_include 10.0.0.0/24,10.1.0.0/24" in line
    # Open MPI's runtime matches names only: every host's, each host takes the ones it has.
    assert "--mca oob_tcp_if_include enp6s0,eth1,ib0" in line
    assert "--mca plm_rsh_args -o BatchMode=yes -o ConnectTimeout=10" in line
    first, second = line.split(" : ")
    assert "-np 2 -x GLOO_SOCKET_IFNAME=enp6s0 -x NCCL_SOCKET_IFNAME==enp6s0" in first
    assert second.startswith("-np 1 -x GLOO_SOCKET_IFNAME=eth1,ib0 -x NCCL_SOCKET_IFNAME==eth1")
    assert "FI_TCP_IFACE" not in line


def test_dry_run_without_reachable_hosts_still_prints_the_line_and_warns():
    result = run_ringrun(
        "--dry-run", "-H", "no-such-host.invalid:1,localhost:1", "python", "x.py", timeout=90
    )
    assert result.returncode == 0
    assert "-hosts no-such-host.invalid:1,localhost:1" in result.stdout
    assert "unknown host name" in result.stderr and "a real run would stop here" in result.stderr


def test_a_real_run_stops_before_starting_anything_when_a_host_fails_the_preflight(tmp_path):
    marker = tmp_path / "ran"
    result = run_ringrun(
        "-H",
        "localhost:1,no-such-host.invalid:1",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
        timeout=90,
    )
    assert result.returncode == 255
    assert "cannot start the job: host no-such-host.invalid (rank 1): unknown host name" in (
        result.stderr
    )
    assert not Path(marker).exists()
