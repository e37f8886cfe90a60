"""ringrun's multi-host preflight: reach every host, learn its facts, find the shared network.

Before a job on several hosts (and for ``ringrun --check -H ...``), ringrun starts
``python -m ringplug.run.hosts.probe`` on every host through ssh, with the same interpreter path
and ssh options the MPI launcher will use, and on its own machine directly. That answers,
per host and before any rank exists:

- can this machine log in there without a password prompt, and if not, why (the reasons
  of :mod:`ringplug.run.hosts.ssh`);
- does the job's Python exist there, with ringplug, and which versions of Python, ringplug,
  MPI and the frameworks it has;
- which of its addresses the other hosts can actually open TCP connections to. Every probe
  tries every other probe's addresses, and an address counts only when the probe of the
  expected host answers (see :mod:`ringplug.run.hosts.probe`), so ``lo``, a ``docker0`` that
  exists with the same address on every host, and networks only some hosts are on are
  left out. What is left, per host, is what MPI and NCCL are told to use.
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ringplug.run.hosts.netinfo import Interface, candidate_interfaces, local_addresses
from ringplug.run.hosts.probe import LINE_PREFIX, MAX_PARALLEL_CONNECTS
from ringplug.run.hosts.spec import Host, is_this_machine
from ringplug.run.hosts.ssh import HostProblem, SshOptions, diagnose
from ringplug.run.launch.mpi import NetworkChoice

CONNECT_TIMEOUT_S = 3.0
"""How long one probe waits for a TCP connection to another host's address."""

# Variables that reach the ranks through the launcher (hydra passes its whole environment)
# and decide which Python and MPI a process on the host gets: the probe runs with them too.
_PROBE_ENVIRONMENT = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "MPI4PY_LIBMPI")
_RESOLVE_TIMEOUT_S = 5.0
_CLOSE_TIMEOUT_S = 3.0

# Versions that must agree between hosts (a mismatch stops the job) and ones that should.
_MUST_MATCH = {"ringplug": "ringplug", "mpich": "MPICH (the mpich wheel)"}
_SHOULD_MATCH = {
    "mpi4py": "mpi4py",
    "torch": "torch",
    "lightning": "lightning",
    "tensorflow": "tensorflow",
    "keras": "keras",
    "jax": "jax",
}

THIS_MACHINE = "this machine"


@dataclass
class HostReport:
    """What the preflight learned about one host.

    Args:
        name: the host as given in ``-H`` or the hostfile, or :data:`THIS_MACHINE` for
            ringrun's machine when it runs no ranks.
        in_job: whether ranks run there.
        local: whether it is the machine ringrun runs on (reached without ssh).
        facts: what its probe reported (see :func:`ringplug.run.hosts.probe.host_facts`), or
            ``None`` when the probe did not answer.
        problem: why the probe did not answer, when it did not.
        seconds: how long the probe took to answer.
        usable: its addresses that every host it must talk to reached, best first.
        rejected: its other candidate addresses, each with why it was left out.
        token: the random token its probe answers connections with.
        port: the port its probe listens on.
    """

    name: str
    in_job: bool
    local: bool
    facts: dict[str, Any] | None = None
    problem: HostProblem | None = None
    seconds: float | None = None
    usable: list[Interface] = field(default_factory=list)
    rejected: list[tuple[Interface, str]] = field(default_factory=list)
    token: str | None = None
    port: int | None = None

    @property
    def interfaces(self) -> list[Interface]:
        """Every IPv4 address the host reported."""
        if self.facts is None:
            return []
        return [Interface.from_dict(values) for values in self.facts.get("interfaces", [])]

    @property
    def candidates(self) -> list[Interface]:
        """The addresses worth trying: up, not loopback, not link-local; best first."""
        return candidate_interfaces(self.interfaces)

    @property
    def usable_names(self) -> list[str]:
        """Names of the usable interfaces, best first, each once."""
        return list(dict.fromkeys(interface.name for interface in self.usable))

    def version(self, name: str) -> str | None:
        """An installed distribution's version on the host, as its probe reported it."""
        if self.facts is None:
            return None
        return self.facts.get("versions", {}).get(name)

    @property
    def label(self) -> str:
        """How reports name the host: its ``-H`` name and, if different, its hostname."""
        hostname = (self.facts or {}).get("hostname")
        if hostname and hostname != self.name:
            return f"{self.name} ({hostname})"
        return self.name


@dataclass
class Preflight:
    """The outcome of :func:`run_preflight`.

    Args:
        hosts: the job's hosts, in ``-H`` order.
        launcher: ringrun's machine (the same object as a job host when it runs ranks).
        problems: what would stop the job, each with its fix.
        warnings: what might go wrong, each with advice.
        probed: whether the connection round ran (two or more probes answered and no
            interfaces were named by the user).
        requested: the interface names the user gave, if any.
    """

    hosts: list[HostReport]
    launcher: HostReport
    problems: list[HostProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    probed: bool = False
    requested: list[str] = field(default_factory=list)

    @property
    def participants(self) -> list[HostReport]:
        """Every host a probe ran on: the job's hosts, and ringrun's machine if it is not one."""
        if any(report is self.launcher for report in self.hosts):
            return list(self.hosts)
        return [*self.hosts, self.launcher]

    def network_choice(self) -> NetworkChoice | None:
        """The interfaces to hand MPI and NCCL, or ``None`` when nothing was decided.

        Per-host names only matter when ranks on different hosts talk, so a job on one host
        gets none; the launcher's interface (for its proxies' connections) is chosen
        whenever one was found.
        """
        job = [report for report in self.hosts if report.usable]
        per_host: dict[str, list[str]] = {}
        if len(self.hosts) >= 2 and len(job) == len(self.hosts):
            per_host = {report.name: report.usable_names for report in self.hosts}
        launcher = self.launcher.usable_names[:1]
        if not per_host and not launcher:
            return None
        subnets = sorted(
            {interface.network for report in job for interface in report.usable},
            key=lambda network: ipaddress.ip_network(network),
        )
        rdma = frozenset(
            report.name for report in self.hosts if report.facts and report.facts.get("rdma")
        )
        return NetworkChoice(
            per_host=per_host,
            launcher_interface=launcher[0] if launcher else None,
            subnets=subnets if per_host else [],
            rdma_hosts=rdma,
        )


def _resolve(name: str) -> set[str]:
    """IPv4 addresses of ``name``; empty when it does not resolve (in time)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return set()
    return {info[4][0] for info in infos}


def local_host_names(hosts: Sequence[Host]) -> set[str]:
    """Which of ``hosts`` are the machine ringrun runs on, by name or by address.

    Names are resolved (all at once, each bounded) and compared with this machine's
    addresses, so ``-H 10.0.0.1`` on the machine that has ``10.0.0.1`` is local.
    """
    own = local_addresses()
    local = {host.name for host in hosts if is_this_machine(host.name)}
    rest = [host.name for host in hosts if host.name not in local]
    literal = {name for name in rest if _is_address(name)}
    local |= {name for name in literal if name in own}
    names = [name for name in rest if name not in literal]
    if names:
        pool = ThreadPoolExecutor(max_workers=min(len(names), 32))
        futures = {name: pool.submit(_resolve, name) for name in names}
        deadline = time.monotonic() + _RESOLVE_TIMEOUT_S
        for name, future in futures.items():
            try:
                addresses = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a resolver that hangs or fails: not local
                continue
            if addresses & own:
                local.add(name)
        # A hung resolver must not hold ringrun up; its thread is left to finish alone.
        pool.shutdown(wait=False)
    return local


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Probe:
    """One running ``python -m ringplug.run.hosts.probe`` and the lines it printed."""

    def __init__(self, report: HostReport, argv: list[str], env: Mapping[str, str]) -> None:
        self.report = report
        self.started = time.monotonic()
        self.messages: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.output: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self.readers: list[threading.Thread] = []
        try:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(env),
                start_new_session=True,
            )
        except OSError as error:
            self.output.append(f"{argv[0]}: {error.strerror}")
            return
        assert self.process.stdout is not None and self.process.stderr is not None
        self.readers = [
            threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stderr,), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            if line.startswith(LINE_PREFIX):
                try:
                    self.messages.put(json.loads(line[len(LINE_PREFIX) :]))
                    continue
                except ValueError:
                    pass
            self.output.append(line.rstrip("\n"))

    def expect(self, kind: str, deadline: float) -> dict[str, Any] | None:
        """The next message of ``kind``, or ``None`` if the probe ended or time ran out."""
        while True:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return None
            try:
                message = self.messages.get(timeout=min(timeout, 0.05))
            except queue.Empty:
                if self.process is None or self.process.poll() is not None:
                    for reader in self.readers:
                        reader.join(1.0)
                    if self.messages.empty():
                        return None
                continue
            if message.get("kind") == kind:
                return message

    def send(self, message: dict[str, Any]) -> None:
        if self.process is None or self.process.stdin is None:
            return
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except OSError:
            pass

    def close(self) -> None:
        """End the probe: end of input asks it to leave; a probe that does not is killed."""
        if self.process is None:
            return
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, 9)
            except OSError:
                self.process.kill()
            self.process.wait()
        for reader in self.readers:
            reader.join(1.0)


def _probe_command(
    python: str, needed_files: Sequence[str], mpi_library: bool, environ: Mapping[str, str]
) -> list[str]:
    """``env VAR=... python -m ringplug.run.hosts.probe ...``: what runs on each host."""
    arguments = [python, "-m", "ringplug.run.hosts.probe"]
    for path in needed_files:
        arguments += ["--need", path]
    if mpi_library:
        arguments.append("--mpi-library")
    assignments = [f"{name}={environ[name]}" for name in _PROBE_ENVIRONMENT if name in environ]
    return ["env", *assignments, *arguments] if assignments else arguments


def run_preflight(
    hosts: Sequence[Host],
    ssh: SshOptions,
    python: str,
    timeout_s: float,
    needed_files: Sequence[str] = (),
    requested_interfaces: Sequence[str] = (),
    mpi_library: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Preflight:
    """Probe every host of a job (see the module's description) and judge what was found.

    Args:
        hosts: the job's hosts.
        ssh: options for ssh, as the launcher will get them.
        python: the interpreter the ranks run with, at the same path on every host.
        timeout_s: how long every host gets to answer over ssh (``math.inf``: no limit).
        needed_files: other executables the job runs on every host (hydra's proxy).
        requested_interfaces: interface names the user gave; then no connection round
            runs, and each host gets those of the names it has.
        mpi_library: also ask every host which MPI library mpi4py loads (slower).
        environ: ringrun's environment. Defaults to ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    local = local_host_names(hosts)
    reports = [HostReport(host.name, in_job=True, local=host.name in local) for host in hosts]
    launcher = next((report for report in reports if report.local), None)
    if launcher is None:
        launcher = HostReport(THIS_MACHINE, in_job=False, local=True)
    preflight = Preflight(hosts=reports, launcher=launcher, requested=list(requested_interfaces))
    command = _probe_command(python, needed_files, mpi_library, environ)
    probes: list[_Probe] = []
    try:
        for report in preflight.participants:
            if report.local and report is not launcher:
                continue  # a second name for this machine: its one probe speaks for it
            if report.local:
                probes.append(_Probe(report, command, environ))
            else:
                argv = ssh.command(report.name, shlex.join(command))
                probes.append(_Probe(report, argv, environ))
        _gather_hellos(probes, timeout_s, python, needed_files)
        answered = [probe for probe in probes if probe.report.facts is not None]
        if requested_interfaces:
            _apply_requested(preflight, requested_interfaces)
        elif len(answered) >= 2:
            _connection_round(answered, preflight)
            preflight.probed = True
    finally:
        for probe in probes:
            probe.close()
    for report in reports:
        if report.local and report is not launcher:
            report.facts, report.seconds = launcher.facts, launcher.seconds
            report.usable, report.rejected = launcher.usable, launcher.rejected
    _judge(preflight, needed_files)
    return preflight


def _gather_hellos(
    probes: Sequence[_Probe], timeout_s: float, python: str, needed_files: Sequence[str]
) -> None:
    """Wait (all at once, bounded) for every probe's facts; explain the ones that fail."""
    deadline = time.monotonic() + timeout_s
    for probe in probes:
        hello = probe.expect("hello", deadline)
        report = probe.report
        if hello is not None:
            report.facts = hello["facts"]
            report.token = hello["token"]
            report.port = int(hello["port"])
            report.seconds = time.monotonic() - probe.started
            continue
        returncode = None if probe.process is None else probe.process.poll()
        if probe.process is None:
            returncode = 127
        report.problem = diagnose(report.name, probe.output, returncode, python, needed_files)


def _connection_round(probes: Sequence[_Probe], preflight: Preflight) -> None:
    """Every probe connects to every other probe's candidate addresses; judge each address."""
    by_key = {str(index): probe.report for index, probe in enumerate(probes)}
    by_token = {probe.report.token: probe.report for probe in probes}
    most = 0
    for index, probe in enumerate(probes):
        targets = [
            {"key": str(other_index), "address": interface.address, "port": other.report.port}
            for other_index, other in enumerate(probes)
            if other_index != index
            for interface in other.report.candidates
        ]
        most = max(most, len(targets))
        probe.send({"kind": "connect", "targets": targets, "timeout": CONNECT_TIMEOUT_S})
    # A probe tries up to MAX_PARALLEL_CONNECTS addresses at a time, each for at most
    # CONNECT_TIMEOUT_S; on a big cluster with silent addresses that takes several rounds.
    rounds = -(-most // MAX_PARALLEL_CONNECTS)
    deadline = time.monotonic() + CONNECT_TIMEOUT_S * max(1, rounds) + 10.0
    # reached[(target host name, address)] = {source host name: outcome text or None if ok}
    outcomes: dict[tuple[str, str], dict[str, str | None]] = {}
    for probe in probes:
        answer = probe.expect("connected", deadline)
        source = probe.report
        for result in (answer or {}).get("results", []):
            target = by_key.get(str(result.get("key")))
            if target is None:
                continue
            if result["address"] in {interface.address for interface in source.interfaces}:
                # Connecting there never leaves the source host, whatever answers.
                outcome: str | None = (
                    f"{source.name} has this address too (the same address on several hosts, "
                    "as Docker's bridge docker0 has), so it does not lead from one host to another"
                )
            elif not result.get("ok"):
                outcome = f"not reached from {source.name} ({result.get('error')})"
            elif result.get("token") == target.token:
                outcome = None
            elif result.get("token") in by_token:
                other = by_token[result["token"]]
                outcome = (
                    f"from {source.name} this address leads to "
                    f"{'itself' if other is source else other.name}, not to {target.name}"
                )
            else:
                outcome = f"from {source.name} something else answers at this address"
            outcomes.setdefault((target.name, result["address"]), {})[source.name] = outcome
        if answer is None:
            preflight.warnings.append(
                f"the probe on {source.name} did not report its connection tests in time"
            )
    job = [report for report in preflight.hosts if report.facts is not None]
    for probe in probes:
        report = probe.report
        if report.in_job:
            required = {other.name for other in job if other is not report}
        else:
            required = {other.name for other in job}
        for interface in report.candidates:
            seen = outcomes.get((report.name, interface.address), {})
            failures = [
                seen.get(name) or f"not tested from {name}"
                for name in sorted(required)
                if name not in seen or seen[name] is not None
            ]
            if failures:
                report.rejected.append((interface, "; ".join(failures)))
            else:
                report.usable.append(interface)


def _apply_requested(preflight: Preflight, requested: Sequence[str]) -> None:
    """Give each host those of the requested interface names it has (with an address)."""
    for report in preflight.participants:
        if report.facts is None:
            continue
        by_name = {interface.name: interface for interface in reversed(report.candidates)}
        report.usable = [by_name[name] for name in requested if name in by_name]
        report.rejected = [
            (interface, "not named by --network-interface")
            for interface in report.candidates
            if interface.name not in requested
        ]


def _judge(preflight: Preflight, needed_files: Sequence[str]) -> None:
    """Turn the facts into problems (with fixes) and warnings."""
    answered = [report for report in preflight.participants if report.facts is not None]
    for report in preflight.participants:
        if report.problem is not None and report.problem not in preflight.problems:
            preflight.problems.append(report.problem)
    for report in answered:
        for path in needed_files:
            if not (report.facts or {}).get("files", {}).get(path, True):
                preflight.problems.append(
                    HostProblem(
                        report.name,
                        "MPI missing",
                        f"the MPI launcher's helper {path} does not exist there (the launcher "
                        "starts it on every host at the path it has on this machine)",
                        "install the same virtualenv (with the mpich wheel) at the same path "
                        f"on {report.name}, or put it on a filesystem all hosts share",
                    )
                )
    if preflight.launcher.facts is not None:
        for report in answered:
            if report is not preflight.launcher:
                _compare_versions(preflight, preflight.launcher, report)
    _judge_network(preflight, answered)


def _compare_versions(preflight: Preflight, here: HostReport, there: HostReport) -> None:
    """Problems and warnings for what ``there`` has installed differently from ``here``."""
    for name, title in _MUST_MATCH.items():
        mine, theirs = here.version(name), there.version(name)
        if mine == theirs:
            continue
        if mine is None:
            fix = f"uninstall {name} on {there.name}, or install the same version here"
        else:
            python = (there.facts or {}).get("executable", "python")
            fix = f"install the same version there: `{python} -m pip install {name}=={mine}`"
        preflight.problems.append(
            HostProblem(
                there.name,
                "version mismatch",
                f"{title} {theirs or 'is not installed'} there, {mine or 'not installed'} here",
                fix,
            )
        )
    python_here = str((here.facts or {}).get("python", ""))
    python_there = str((there.facts or {}).get("python", ""))
    if python_here.split(".")[:2] != python_there.split(".")[:2]:
        preflight.warnings.append(
            f"{there.name} runs Python {python_there} and this machine {python_here}; the "
            "objects ranks exchange are pickled, so keep one Python version on every host"
        )
    library_here = (here.facts or {}).get("mpi_library")
    library_there = (there.facts or {}).get("mpi_library")
    if library_here and library_there and library_here != library_there:
        preflight.problems.append(
            HostProblem(
                there.name,
                "MPI mismatch",
                f"mpi4py loads {library_there} there and {library_here} here",
                "use one MPI on every host: the same wheel (`pip install mpich==VERSION`) or "
                "the same cluster module; MPI4PY_LIBMPI must point at the same library",
            )
        )
    for name, title in _SHOULD_MATCH.items():
        mine, theirs = here.version(name), there.version(name)
        if mine != theirs and mine is not None:
            preflight.warnings.append(
                f"{title} {theirs or 'is not installed'} on {there.name}, {mine} on this "
                "machine; install the same version on every host"
            )


def _judge_network(preflight: Preflight, answered: Sequence[HostReport]) -> None:
    """A problem for every host that no usable address was found for, where one is needed."""
    job = [report for report in preflight.hosts if report.facts is not None]
    for report in answered:
        if report.usable:
            continue
        if preflight.probed:
            if report.in_job and len(job) < 2:
                continue  # ranks on one host only: they talk over shared memory
            if report.in_job:
                where = "the other hosts"
                fix = (
                    "open TCP between the hosts on all ports (the ranks listen on ports the "
                    "system picks), or name the interfaces to use with --network-interface"
                )
            else:
                where = "the job's hosts (the launcher's proxies connect back to this machine)"
                fix = (
                    "run ringrun on one of the job's hosts, or let the hosts reach this "
                    "machine over TCP on all ports"
                )
            tried = "; ".join(
                f"{interface.describe()}: {why}" for interface, why in report.rejected
            )
            preflight.problems.append(
                HostProblem(
                    report.name,
                    "no shared network",
                    f"none of its addresses can be reached from {where}: "
                    f"{tried or 'it has no address besides loopback'}",
                    fix,
                )
            )
        elif preflight.requested and report.in_job:
            names = ", ".join(interface.describe() for interface in report.candidates)
            preflight.problems.append(
                HostProblem(
                    report.name,
                    "interface missing",
                    "it has none of the interfaces named with --network-interface; its "
                    f"interfaces: {names or 'none besides loopback'}",
                    "add its interface to the list (--network-interface NAME, repeatable), "
                    "or leave --network-interface out and let ringrun find the interfaces "
                    "that route between the hosts",
                )
            )
