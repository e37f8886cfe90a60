"""A multi-host bed on one machine: network namespaces as hosts, one real sshd each.

Each "host" is a Linux network namespace with its own UTS namespace (so its own hostname),
joined to the others through a bridge in a "switch" namespace by a veth pair. A host may
have decoys: a ``docker0`` bridge with ``172.17.0.1/16`` (the same address on every host,
as Docker gives it) and a ``virbr0`` on a network no other host has. Ranks reach each other
only through the bridge; nothing touches the machine's own network, ``/etc/hosts`` or
``~/.ssh``. The links can be shaped with ``tc`` (:class:`Shape`: a delay each way and a
rate), as a cluster's network would be.

Ranks start as on a cluster: the MPI launcher runs ``ssh`` to each host's ``sshd``, with
keys, host keys, ``known_hosts`` and an ssh config file that live in the bed's own
directory (passed to ringrun with ``--ssh-config-file``). The namespaces share the
filesystem, so the virtualenv's absolute path works everywhere, as on a cluster with a
shared home.

`ringplug-bench scale` builds a bed of :func:`uniform_hosts`; the tests' bed
(tests/netbed.py) has hosts that are wrong in given ways (no sshd, no Python). A bed can
take a host away mid-job as a crash would (:meth:`NetBed.kill_host`: its sshd and every
process there SIGKILLed) and start its sshd again afterwards (:meth:`NetBed.revive_host`).

Set-up and teardown are idempotent: names carry the owner's pid, a bed whose owner died
(a crashed run) is removed at the next set-up, and teardown kills every process left in
the bed's namespaces before deleting them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "rpbed"
STATE_ROOT = Path(tempfile.gettempdir()) / "ringplug-netbed"
SUBNET = "10.203.0"
SSHD = "/usr/sbin/sshd"
_COMMAND_TIMEOUT_S = 20
_SSHD_START_TIMEOUT_S = 15


@dataclass(frozen=True)
class HostSpec:
    """One host of the bed: its key in tests, link name, address and what is wrong with it."""

    key: str
    link: str
    address: str
    sshd: bool = True
    hide_python: bool = False
    extra_decoy: bool = False
    decoys: bool = True  # a docker0 with Docker's address (every host of the tests' bed)

    @property
    def hostname(self) -> str:
        return f"bed-{self.key}"


def uniform_hosts(count: int) -> tuple[HostSpec, ...]:
    """`count` healthy hosts ``h0``, ``h1``, ... with link ``eth0`` and no decoys."""
    if not 1 <= count <= 90:
        raise ValueError(f"a bed has 1 to 90 hosts, not {count}")
    return tuple(
        HostSpec(f"h{index}", "eth0", f"{SUBNET}.{index + 1}", decoys=False)
        for index in range(count)
    )


@dataclass(frozen=True)
class Shape:
    """How every link of the bed is shaped with ``tc``, as a cluster's network would be.

    Args:
        delay_us: one-way delay added on each side of every link (``netem``), default 0.
        rate_gbit: rate of every link in Gbit/s (``netem``'s rate, or ``tbf`` where the
            kernel has no ``netem``), default 0 (unshaped).
    """

    delay_us: float = 0.0
    rate_gbit: float = 0.0

    def netem(self) -> list[str]:
        words = ["netem"]
        if self.delay_us:
            words += ["delay", f"{self.delay_us:g}us"]
        if self.rate_gbit:
            words += ["rate", f"{self.rate_gbit:g}gbit"]
        return words

    def tbf(self) -> list[str]:
        # The bucket holds 2 ms of the rate: more than the kernel's timer tick and a
        # segmentation-offloaded packet, so the rate holds without drops.
        burst = max(int(self.rate_gbit * 1e9 / 8 * 2e-3), 1 << 16)
        return ["tbf", "rate", f"{self.rate_gbit:g}gbit", "burst", str(burst), "latency", "50ms"]


class BedUnavailable(RuntimeError):
    """The bed cannot be built here; the message says why (tests skip with it)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespace_pids(namespace: str) -> list[int]:
    result = _run("ip", "netns", "pids", namespace, check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def _kill_namespace(namespace: str) -> None:
    """Kill every process in ``namespace`` (all started by the bed), then delete it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = _namespace_pids(namespace)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _run("ip", "netns", "del", namespace, check=False)


def remove_stale_beds() -> None:
    """Remove beds whose owning process is gone (a run that crashed or was killed)."""
    listing = _run("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listing:
        name = line.split(" ")[0]
        parts = name.split("-")
        owned = len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit()
        if owned and not _alive(int(parts[1])):
            _kill_namespace(name)
    if STATE_ROOT.is_dir():
        for directory in STATE_ROOT.iterdir():
            if directory.name.isdigit() and not _alive(int(directory.name)):
                shutil.rmtree(directory, ignore_errors=True)


def check_available() -> None:
    """Raise :class:`BedUnavailable` with the reason when the bed cannot be built."""
    if not sys.platform.startswith("linux"):
        raise BedUnavailable("network namespaces need Linux")
    if os.geteuid() != 0:
        raise BedUnavailable("creating network namespaces needs root (CI runs as root)")
    if shutil.which("ip") is None:
        raise BedUnavailable("iproute2's `ip` is not installed")
    if shutil.which("unshare") is None:
        raise BedUnavailable("util-linux's `unshare` is not installed")
    if not os.access(SSHD, os.X_OK):
        raise BedUnavailable(
            f"{SSHD} is missing: install openssh-server (.ci/run does: apt-get install "
            "openssh-server)"
        )
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        raise BedUnavailable("the ssh client (openssh-client) is not installed")


class NetBed:
    """The bed: build with :meth:`start`, always end with :meth:`stop` (idempotent)."""

    def __init__(self, hosts: Sequence[HostSpec], shape: Shape | None = None) -> None:
        self.hosts = tuple(hosts)
        self.shape = shape
        self.shaping = "none"  # what `tc` could do here (set by `start`)
        self.owner = os.getpid()
        self.directory = STATE_ROOT / str(self.owner)
        self.sshd: dict[str, subprocess.Popen[bytes]] = {}
        self.namespaces: list[str] = []

    # ------------------------------------------------------------------ names and paths
    def namespace(self, key: str) -> str:
        return f"{PREFIX}-{self.owner}-{key}"

    def host(self, key: str) -> HostSpec:
        return next(host for host in self.hosts if host.key == key)

    def address(self, key: str) -> str:
        return self.host(key).address

    @property
    def ssh_config(self) -> Path:
        return self.directory / "ssh_config"

    # ------------------------------------------------------------------ building
    def start(self) -> NetBed:
        check_available()
        if self.shape is not None and shutil.which("tc") is None:
            raise BedUnavailable("shaping the links needs iproute2's `tc`")
        remove_stale_beds()
        self.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._make_network()
        except RuntimeError as error:
            self.stop()
            raise BedUnavailable(f"cannot build network namespaces: {error}") from None
        self._make_keys()
        for host in self.hosts:
            if host.sshd:
                self._start_sshd(host)
        return self

    def _make_network(self) -> None:
        switch = self.namespace("switch")
        for name in [switch, *(self.namespace(host.key) for host in self.hosts)]:
            _run("ip", "netns", "add", name)
            self.namespaces.append(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            namespace = self.namespace(host.key)
            # The decoys come first, so "the first interface that is not lo" is a decoy.
            if host.decoys:
                _run("ip", "-n", namespace, "link", "add", "docker0", "type", "bridge")
                _run("ip", "-n", namespace, "addr", "add", "172.17.0.1/16", "dev", "docker0")
                _run("ip", "-n", namespace, "link", "set", "docker0", "up")
            if host.extra_decoy:
                _run("ip", "-n", namespace, "link", "add", "virbr0", "type", "bridge")
                _run("ip", "-n", namespace, "addr", "add", "192.168.122.1/24", "dev", "virbr0")
                _run("ip", "-n", namespace, "link", "set", "virbr0", "up")
            port = f"port{index}"
            _run(
                "ip",
                "-n",
                switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                host.link,
                "netns",
                namespace,
            )
            _run("ip", "-n", switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", switch, "link", "set", port, "up")
            _run("ip", "-n", namespace, "addr", "add", f"{host.address}/24", "dev", host.link)
            _run("ip", "-n", namespace, "link", "set", host.link, "up")
        if self.shape is not None:
            self.shaping = self._shape_links(self.shape)

    def _shape_links(self, shape: Shape) -> str:
        """Shape both ends of every link (the host's side and the switch's port, so the
        delay is paid each way); returns what was applied. Without ``netem`` in the kernel
        only the rate can be shaped (``tbf``), and the delay is left out."""
        ends = [(self.namespace(host.key), host.link) for host in self.hosts]
        ends += [(self.namespace("switch"), f"port{i}") for i in range(len(self.hosts))]
        qdisc, missing = shape.netem(), ""
        probe = _run("tc", "-n", ends[0][0], "qdisc", "replace", "dev", ends[0][1], "root",
                     *qdisc, check=False)  # fmt: skip
        if probe.returncode != 0:
            if not shape.rate_gbit:
                return f"none (netem: {probe.stderr.strip()})"
            qdisc = shape.tbf()
            missing = f"; no delay: netem is missing ({probe.stderr.strip()})"
        for namespace, link in ends:
            _run("tc", "-n", namespace, "qdisc", "replace", "dev", link, "root", *qdisc)
        return " ".join(qdisc) + " on both ends of every link" + missing

    def _make_keys(self) -> None:
        directory = self.directory
        for name in ("host_key", "id_ed25519"):
            (directory / name).unlink(missing_ok=True)
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name))
        shutil.copy(directory / "id_ed25519.pub", directory / "authorized_keys")
        key = " ".join((directory / "host_key.pub").read_text().split()[:2])
        addresses = ",".join(host.address for host in self.hosts)
        (directory / "known_hosts").write_text(f"{addresses} {key}\n")
        (directory / "sshd_config").write_text(
            "Port 22\nListenAddress 0.0.0.0\n"
            f"HostKey {directory / 'host_key'}\n"
            f"AuthorizedKeysFile {directory / 'authorized_keys'}\n"
            # The key files live under /tmp, which StrictModes refuses (world-writable).
            "StrictModes no\nPermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "PrintMotd no\nMaxStartups 100\nMaxSessions 100\n"
        )
        self.ssh_config.write_text(
            "Host *\n  User root\n"
            f"  IdentityFile {directory / 'id_ed25519'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {directory / 'known_hosts'}\n"
            "  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n"
        )

    def _start_sshd(self, host: HostSpec) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation
        pid_file = self.directory / f"sshd-{host.key}.pid"
        pid_file.unlink(missing_ok=True)
        script = 'hostname "$1"; '
        if host.hide_python:
            # A host without the job's virtualenv: its directory is empty there.
            script += f"mount -t tmpfs tmpfs {sys.prefix} || exit 1; "
        script += f'exec {SSHD} -D -e -f "$2" -o PidFile="$3"'
        unshare = ["unshare", "--uts"] + (
            ["--mount", "--propagation", "private"] if host.hide_python else []
        )
        log = (self.directory / f"sshd-{host.key}.log").open("wb")
        process = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.namespace(host.key),
                *unshare,
                "--",
                "sh",
                "-c",
                script,
                "sh",
                host.hostname,
                str(self.directory / "sshd_config"),
                str(pid_file),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        self.sshd[host.key] = process
        deadline = time.monotonic() + _SSHD_START_TIMEOUT_S
        # sshd writes its pid file once it listens.
        while not pid_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                text = (self.directory / f"sshd-{host.key}.log").read_text()
                raise RuntimeError(f"sshd on {host.key} did not start: {text.strip()}")
            time.sleep(0.02)

    # ------------------------------------------------------------------ using
    def command(self, key: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as a process on host ``key``: in its network, with its hostname."""
        host = self.host(key)
        return [
            "ip",
            "netns",
            "exec",
            self.namespace(key),
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            host.hostname,
            *argv,
        ]

    def kill_host(self, key: str) -> list[int]:
        """Take host ``key`` away as a crash would: SIGKILL its sshd and every process it
        started (all of its namespace), at once and without warning. Its address stays, with
        nothing listening on it; returns the pids killed."""
        namespace = self.namespace(key)
        killed: list[int] = []
        deadline = time.monotonic() + 10
        while pids := _namespace_pids(namespace):  # a process may fork while the others die
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} of host {key} outlived SIGKILL")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += [pid for pid in pids if pid not in killed]
            time.sleep(0.05)
        process = self.sshd.pop(key, None)
        if process is not None:
            process.wait(5)
        return killed

    def revive_host(self, key: str) -> None:
        """Start host ``key``'s sshd again after :meth:`kill_host` (no-op if it runs)."""
        if key not in self.sshd:
            self._start_sshd(self.host(key))

    def processes(self) -> list[int]:
        """Pids of every process in the bed's host namespaces (sshd and what it started)."""
        return [pid for host in self.hosts for pid in _namespace_pids(self.namespace(host.key))]

    # ------------------------------------------------------------------ tearing down
    def stop(self) -> None:
        """Stop every daemon and process of the bed and delete its namespaces; idempotent."""
        for process in self.sshd.values():
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.sshd.clear()
        listing = _run("ip", "netns", "list", check=False).stdout
        mine = {line.split(" ")[0] for line in listing.splitlines()}
        for name in [self.namespace(host.key) for host in self.hosts] + [self.namespace("switch")]:
            if name in mine:
                _kill_namespace(name)
        self.namespaces.clear()
        shutil.rmtree(self.directory, ignore_errors=True)
