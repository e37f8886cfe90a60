"""The ``ringrun`` command: start N ranks of a program through the installed MPI launcher.

Example::

    ringrun -np 4 python train.py
    ringrun -np 4 -H node1:2,node2:2 python train.py   # interfaces found by probing
    ringrun -np 2 --dry-run python train.py     # print the mpiexec line, run nothing
    ringrun --check                             # what MPI and frameworks ranks would use
    ringrun --check -H node1,node2              # and whether the hosts are ready

horovodrun's flags are accepted too (see :mod:`ringplug.run.horovodrun`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ringplug.run.check import CheckContext, run_check
from ringplug.run.configfile import load_config_file
from ringplug.run.horovodrun import TIMELINE_CYCLES_NOTE, add_horovodrun_flags, refusal
from ringplug.run.hosts import (
    Host,
    HostSpecError,
    in_batch_allocation,
    parse_host_list,
    parse_hostfile,
    rank_hosts,
    total_slots,
)
from ringplug.run.launcher import START_FAILED_EXIT_CODE, JobResult, StartWatch, run_job
from ringplug.run.mpi import (
    FORWARDED_VARIABLES,
    JobSpec,
    LauncherError,
    MpiLauncher,
    build_plan,
    find_launcher,
    remote_executables,
)
from ringplug.run.preflight import Preflight, run_preflight
from ringplug.run.settings import (
    BIND_CHOICES,
    DEFAULT_START_TIMEOUT_S,
    RunSettings,
    SettingsError,
)
from ringplug.run.ssh import DEFAULT_CONNECT_TIMEOUT_S, HostProblem, SshOptions
from ringplug.run.status import EVENTS_VARIABLE, RankStatus

logger = logging.getLogger(__name__)

USAGE_ERROR = 2


class UsageError(Exception):
    """A command line or setting ringrun cannot act on; reported with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every flag's help says what it means, not how it is spelled."""
    parser = argparse.ArgumentParser(
        prog="ringrun",
        usage="ringrun -np N [options] [--] command [args...]",
        description="Run a ringplug program on N ranks through the installed MPI launcher "
        "(MPICH hydra or Open MPI).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "-np",
        "-n",
        "--num-proc",
        dest="np",
        type=int,
        metavar="N",
        help="number of ranks (default: total slots of -H/--hostfile)",
    )
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H",
        "--hosts",
        metavar="HOST:SLOTS,...",
        help="hosts and their slot counts, e.g. node1:2,node2:2; ranks fill "
        "each host before the next",
    )
    hosts.add_argument(
        "--hostfile",
        metavar="FILE",
        help="file with one 'host:slots', 'host slots=N' or 'host' per line",
    )
    parser.add_argument(
        "--network-interface",
        action="append",
        dest="network_interfaces",
        metavar="IF",
        help="network interface for MPI and NCCL traffic (repeatable; each host uses the "
        "names it has). Default on several hosts: the interfaces that the preflight finds "
        "routing between all of them",
    )
    parser.add_argument(
        "-p",
        "--ssh-port",
        type=int,
        metavar="PORT",
        help="ssh port for starting ranks on remote hosts",
    )
    parser.add_argument(
        "-i",
        "--ssh-identity-file",
        metavar="FILE",
        help="ssh private key for starting ranks on remote hosts",
    )
    parser.add_argument(
        "--ssh-config-file",
        metavar="FILE",
        help="ssh configuration file to use instead of ~/.ssh/config (ports, keys, "
        "known_hosts per host)",
    )
    parser.add_argument(
        "--no-preflight",
        dest="preflight",
        action="store_const",
        const=False,
        help="do not check the hosts (ssh, Python, versions, interfaces) before a job on "
        "several hosts",
    )
    parser.add_argument(
        "-x",
        action="append",
        dest="env",
        metavar="VAR[=VALUE]",
        help="environment variable for the ranks: VAR=VALUE sets it, VAR "
        "passes ringrun's own value (repeatable)",
    )
    parser.add_argument(
        "--output-filename",
        metavar="DIR",
        help="also write each rank's stdout/stderr to DIR/rank.<rank>/",
    )
    parser.add_argument(
        "--timeline",
        metavar="PATH",
        help="write a Chrome trace of the engine (negotiation, fusion, collectives) to PATH; "
        "open it in Perfetto or chrome://tracing",
    )
    parser.add_argument(
        "--bind-to",
        choices=BIND_CHOICES,
        help="pin each rank to a core or socket (default: the launcher's)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        default=None,
        help="print the launcher command line before running it",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the launcher command line and exit without running it",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="report Python, MPI and framework setup, with warnings, and exit; with -H or "
        "--hostfile, also check every host (ssh, versions, interfaces) and give a verdict",
    )
    parser.add_argument(
        "--bench",
        action="store_true",
        help="with --check: also run a short allreduce sweep on the job's ranks (-np, -H) and "
        "print the bus bandwidth against this machine's memory copy bandwidth",
    )
    parser.add_argument(
        "--config-file",
        metavar="FILE",
        help="YAML or TOML file with these settings; flags override it",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the program to run on every rank, with its arguments",
    )
    add_horovodrun_flags(parser)
    return parser


def _parse_env_flags(values: Sequence[str]) -> dict[str, str | None]:
    """``["A=1", "B"]`` -> ``{"A": "1", "B": None}`` (``None``: forward ringrun's value)."""
    env: dict[str, str | None] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not name:
            raise UsageError(f"-x {item!r}: expected VAR or VAR=VALUE")
        env[name] = value if sep else None
    return env


def _split_mpi_args(values: Sequence[str]) -> list[str]:
    """``['-ppn 2', "-genv A 'b c'"]`` -> the words a shell would make of them, in order."""
    words: list[str] = []
    for value in values:
        try:
            words += shlex.split(value)
        except ValueError as error:
            raise UsageError(f"--mpi-args {value!r}: cannot split it into words: {error}") from None
    return words


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    """Merge ``--config-file`` (if any) with the flags; flags win."""
    flags = RunSettings(
        np=args.np,
        hosts=args.hosts,
        hostfile=args.hostfile,
        network_interfaces=args.network_interfaces or [],
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        ssh_config_file=args.ssh_config_file,
        env=_parse_env_flags(args.env or []),
        output_filename=args.output_filename,
        bind_to=args.bind_to,
        verbose=bool(args.verbose),
        timeline=args.timeline,
        mpi_args=_split_mpi_args(args.mpi_args or []),
        start_timeout=args.start_timeout,
        preflight=args.preflight,
        log_level=args.log_level,
        fusion_threshold_mb=args.fusion_threshold_mb,
        cycle_time_ms=args.cycle_time_ms,
        stall_check=args.stall_check,
        stall_check_warning_time_seconds=args.stall_check_warning_time_seconds,
        stall_check_shutdown_time_seconds=args.stall_check_shutdown_time_seconds,
    )
    if args.config_file is None:
        settings = flags
    else:
        settings = load_config_file(args.config_file)
        if args.hosts or args.hostfile:
            # -H and --hostfile say the same thing; a flag replaces either from the file.
            settings.hosts = settings.hostfile = None
        settings = settings.overridden_by(flags)
    settings.validate()
    return settings


def hosts_from_settings(settings: RunSettings) -> list[Host]:
    """The hosts of ``-H`` or ``--hostfile``; empty for this machine only."""
    if settings.hosts:
        return parse_host_list(settings.hosts)
    if settings.hostfile:
        return parse_hostfile(settings.hostfile)
    return []


def ssh_from_settings(settings: RunSettings) -> SshOptions:
    """ssh options from the settings; ssh's connect timeout stays within the start timeout."""
    limit = settings.effective_start_timeout or DEFAULT_START_TIMEOUT_S
    return SshOptions(
        port=settings.ssh_port,
        identity_file=_absolute(settings.ssh_identity_file),
        config_file=_absolute(settings.ssh_config_file),
        connect_timeout_s=max(1, min(DEFAULT_CONNECT_TIMEOUT_S, math.ceil(limit))),
    )


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().resolve())


def job_from_settings(settings: RunSettings, command: list[str]) -> JobSpec:
    """Resolve hosts, rank count and paths into a :class:`JobSpec`."""
    hosts = hosts_from_settings(settings)
    np = settings.np
    if np is None:
        if not hosts:
            raise UsageError("say how many ranks to run with -np N (or give hosts with -H)")
        np = total_slots(hosts)
    env = dict(settings.env)
    # Values the user gave may be secrets (API keys): they stay off every command line. The
    # search paths stay on it: set in the launcher's own environment they would change how
    # the launcher itself runs (and they are no secrets).
    private = {
        name for name, value in env.items() if value is not None and name not in FORWARDED_VARIABLES
    }
    ours: dict[str, str] = {}
    if settings.timeline is not None:
        # Absolute, so rank 0 writes it where the user asked whatever its working directory.
        ours["RINGPLUG_TIMELINE"] = str(Path(settings.timeline).resolve())
    ours.update(settings.rank_variables())
    for name, value in ours.items():
        if env.get(name, value) != value:
            logger.warning(
                "%s=%s from ringrun's settings replaces the value of %s from -x or the config "
                "file's env",
                name,
                value,
                name,
            )
        env[name] = value
        private.discard(name)
    output_dir = None
    if settings.output_filename is not None:
        # Absolute, so ranks find it whatever their working directory.
        output_dir = str(Path(settings.output_filename).resolve())
    return JobSpec(
        np=np,
        command=command,
        hosts=hosts,
        network_interfaces=list(settings.network_interfaces),
        ssh=ssh_from_settings(settings),
        env=env,
        output_dir=output_dir,
        bind_to=settings.bind_to,
        mpi_args=list(settings.mpi_args),
        private=frozenset(private),
    )


# Launcher flags that send the ranks' output to files: the wrappers' reports would go there
# too, and never reach ringrun.
_OUTPUT_REDIRECTS = (
    "-outfile-pattern",
    "-errfile-pattern",
    "--output-filename",
    "-output-filename",
)


def start_watch(spec: JobSpec, settings: RunSettings) -> StartWatch | None:
    """Which ranks ``--start-timeout`` watches: all of them, wherever they run."""
    timeout = settings.effective_start_timeout
    if timeout is None:
        return None
    redirect = next((arg for arg in spec.mpi_args if arg.split("=")[0] in _OUTPUT_REDIRECTS), None)
    if redirect is not None:
        logger.warning(
            "--start-timeout is off: --mpi-args %s sends the ranks' output to files, and "
            "with it the reports that they started",
            redirect,
        )
        return None
    return StartWatch(timeout_s=timeout, ranks=frozenset(range(spec.np)))


def _configure_logging(verbose: bool) -> None:
    """ringrun's own messages go to stderr, prefixed so they stand out from rank output."""
    level = os.environ.get("RINGPLUG_LOG_LEVEL", "INFO" if verbose else "WARNING").upper()
    logging.basicConfig(format="ringrun: %(message)s", level=level, stream=sys.stderr)


def _say(line: str) -> None:
    print(f"ringrun: {line}", file=sys.stderr, flush=True)


def wants_preflight(spec: JobSpec, settings: RunSettings, environ: Mapping[str, str]) -> bool:
    """Whether to check the hosts before the job: remote hosts reached over ssh.

    Inside a batch allocation the launchers start ranks through the scheduler, and ssh
    between its nodes may not even be allowed.
    """
    if settings.preflight is False or not spec.remote_hosts:
        return False
    if in_batch_allocation(environ) and not spec.ssh.customized:
        logger.info("inside a batch allocation: no ssh preflight (the scheduler starts ranks)")
        return False
    return True


def _preflight(
    spec: JobSpec, settings: RunSettings, launcher: MpiLauncher, dry_run: bool
) -> int | None:
    """Check the hosts and settle the interfaces; an exit code if the job cannot start."""
    preflight = run_preflight(
        spec.hosts,
        spec.ssh,
        sys.executable,
        timeout_s=settings.effective_start_timeout or DEFAULT_START_TIMEOUT_S,
        needed_files=remote_executables(launcher),
        requested_interfaces=spec.network_interfaces,
    )
    for warning in preflight.warnings:
        logger.warning("%s", warning)
    if preflight.problems and not dry_run:
        _report_problems(preflight.problems, spec, "cannot start the job")
        _say(
            "these checks ran before any rank started; `ringrun --check -H ...` repeats them "
            "with a full report, and --no-preflight skips them"
        )
        return START_FAILED_EXIT_CODE
    if preflight.problems:
        for problem in preflight.problems:
            logger.warning(
                "%s (a real run would stop here; fix: %s)", problem.describe(), problem.fix
            )
    spec.network = preflight.network_choice()
    if dry_run or settings.verbose:
        for line in _interface_lines(preflight):
            _say(line)
    return None


def _interface_lines(preflight: Preflight) -> list[str]:
    """What the preflight chose per host, for --dry-run and --verbose."""
    lines = []
    for report in preflight.participants:
        if not report.usable and not report.rejected:
            continue
        chosen = ", ".join(interface.describe() for interface in report.usable) or "none"
        left = ", ".join(interface.name for interface, _ in report.rejected)
        how = "found routing between all hosts" if preflight.probed else "named"
        lines.append(
            f"interfaces on {report.label}: {chosen} ({how})"
            + (f"; left out: {left}" if left else "")
        )
    return lines


def _report_problems(problems: Sequence[HostProblem], spec: JobSpec, what: str) -> None:
    """Two lines a problem: what happened on which host (with its ranks), then the fix."""
    placed = rank_hosts(spec.hosts, spec.np) if spec.hosts else []
    for problem in problems:
        ranks = [str(rank) for rank, host in enumerate(placed) if host == problem.host]
        which = f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)})" if ranks else ""
        _say(f"{what}: host {problem.host}{which}: {problem.reason}: {problem.detail}")
        _say(f"  fix: {problem.fix}")


def _launch(spec: JobSpec, settings: RunSettings, dry_run: bool) -> int:
    """Check the hosts, build the launch plan and print it, or run it and report the end."""
    launcher = find_launcher()
    if launcher is not None and wants_preflight(spec, settings, os.environ):
        code = _preflight(spec, settings, launcher, dry_run)
        if code is not None:
            return code
    if dry_run:
        print(build_plan(spec, launcher).shell_line(), flush=True)
        return 0
    token = secrets.token_hex(8)
    environ = {**os.environ, EVENTS_VARIABLE: token}
    plan = build_plan(spec, launcher, environ=environ)
    if settings.verbose:
        _say(plan.shell_line())
    result = run_job(
        plan, environ=environ, events_token=token, start_watch=start_watch(spec, settings)
    )
    if result.stopped_by is not None:
        _say("stopped; all ranks were terminated")
    elif result.not_started:
        for line in _not_started_lines(result, spec, settings):
            _say(line)
    elif result.root is not None and not result.root.left_early:
        for line in _root_cause_lines(result, spec):
            _say(line)
    elif result.host_problems and result.exit_code != 0:
        _report_problems(result.host_problems, spec, "could not start ranks")
    elif result.root is not None:
        for line in _root_cause_lines(result, spec):
            _say(line)
    elif result.unreported and result.exit_code != 0:
        _say(
            f"rank{'s' if len(result.unreported) > 1 else ''} "
            f"{', '.join(map(str, result.unreported))} started but never reported how they "
            "ended: the launcher killed them with their wrappers (hydra does so to every rank "
            "when one leaves without MPI_Finalize, e.g. through os._exit); the launcher exited "
            f"with code {result.launcher_returncode}"
        )
    elif result.exit_code != 0:
        _say(f"the launcher exited with code {result.launcher_returncode}")
        for line in _never_started_lines(result, spec):
            _say(line)
    return result.exit_code


def _root_cause_lines(result: JobResult, spec: JobSpec) -> list[str]:
    """The rank that failed or froze first, how it ended, and what the others said of it."""
    root = result.root
    assert root is not None
    lines = []
    fault = root.fault
    if root.status is not None:
        line = _describe_failure(root.status, spec)
        if root.left_early:
            line += " before the other ranks were done: it left the job early"
            if fault is None:
                code = result.launcher_returncode
                line += ", and the launcher then stopped the others" + (
                    f" (it exited with code {code})" if code else ""
                )
        lines.append(line)
    elif fault is not None and fault.rank != root.rank:
        named = ", ".join(map(str, root.named_by))
        lines.append(
            f"rank {root.rank} stopped taking part in the job (named by rank"
            f"{'s' if len(root.named_by) > 1 else ''} {named}); "
            "it was stopped in the teardown"
        )
    if fault is not None:
        speaker = "it" if fault.rank == root.rank else f"rank {fault.rank}"
        lines.append(f"  {speaker} said: {fault.message}")
    if root.left_early and fault is None:
        lines.append(
            "  a rank must not end (os._exit, a return before the last collective) while "
            "others still run collectives with it"
        )
    others = {s.rank for s in result.failures} - {root.rank}
    if others:
        lines.append(
            f"{len(others)} more rank{'s' if len(others) > 1 else ''} failed after it, most "
            "likely stopped by ringplug or the teardown"
        )
    return lines


def _never_started_lines(result: JobResult, spec: JobSpec) -> list[str]:
    """After a launcher failure: the hosts none of whose ranks started, and what it said."""
    if not spec.hosts or len(result.started) == spec.np:
        return []
    placed = rank_hosts(spec.hosts, spec.np)
    started_hosts = {placed[rank] for rank in result.started if rank < len(placed)}
    silent = [host.name for host in spec.hosts if host.name not in started_hosts]
    if not silent:
        return []
    lines = [f"no rank started on host{'s' if len(silent) > 1 else ''} {', '.join(silent)}"]
    lines += [f"  the launcher said: {line}" for line in result.start_errors]
    lines.append(
        "  `ringrun --check -H HOSTS` checks every host (ssh, Python, MPI) and names the one "
        "that fails, with the fix"
    )
    return lines


def _describe_failure(status: RankStatus, spec: JobSpec) -> str:
    """The failed rank, its host (and where -H put it, if named differently), and how it ended."""
    placed = rank_hosts(spec.hosts, spec.np) if spec.hosts else []
    if status.rank is not None and status.rank < len(placed) and placed[status.rank] != status.host:
        where = placed[status.rank]
        return status.describe().replace(f"(pid {status.pid})", f"(-H {where}, pid {status.pid})")
    return status.describe()


def _not_started_lines(result: JobResult, spec: JobSpec, settings: RunSettings) -> list[str]:
    """What to tell the user when ranks did not start their program in time."""
    placed = rank_hosts(spec.hosts, spec.np) if spec.hosts else []
    by_host: dict[str, list[str]] = {}
    # Without hosts the ranks run here, unless a batch allocation spreads them.
    elsewhere = "a host the scheduler chose" if in_batch_allocation(os.environ) else None
    for rank in result.not_started:
        host = placed[rank] if placed else (elsewhere or socket.gethostname())
        by_host.setdefault(host, []).append(str(rank))
    timeout = settings.effective_start_timeout or 0
    lines = []
    for host, ranks in by_host.items():
        plural = "s" if len(ranks) > 1 else ""
        lines.append(
            f"rank{plural} {', '.join(ranks)} on host {host} did not start the program within "
            f"{timeout:g} s (--start-timeout), so ringrun stopped the job"
        )
        started_there = [
            event for event in result.started.values() if placed and placed[event.rank or 0] == host
        ]
        problem = next((p for p in result.host_problems if p.host == host), None)
        if problem is not None:
            lines.append(f"  host {host}: {problem.reason}: {problem.detail}")
            lines.append(f"  fix: {problem.fix}")
        elif placed and not started_there:
            lines.append(
                f"  no rank on {host} reported starting: the launcher could not start its "
                f"process there (check `ssh {host} true` from this machine)"
            )
    lines.append(
        "check that the hosts are reachable and `ssh HOST true` works there without a "
        "password, that the MPI library the ranks load belongs to the launcher (ringrun "
        "--check -H HOSTS checks both), and that nothing slow runs before the program "
        "starts; or raise the limit with --start-timeout SECONDS (0: no limit)"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ringrun`` console script."""
    parser = build_parser()
    # Known leftovers are horovodrun flags ringrun refuses with a reason; others are errors.
    args, unrecognized = parser.parse_known_args(argv)
    refused = refusal(args, unrecognized)
    if refused is not None:
        print(f"ringrun: error: {refused}", file=sys.stderr, flush=True)
        return USAGE_ERROR
    if unrecognized:
        parser.error(f"unrecognized arguments: {' '.join(unrecognized)}")
    if args.timeline_mark_cycles:
        print(f"ringrun: note: {TIMELINE_CYCLES_NOTE}", file=sys.stderr, flush=True)
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    _configure_logging(bool(args.verbose))
    try:
        settings = settings_from_args(args)
        if args.bench and not args.check:
            raise UsageError("--bench goes with --check: ringrun --check --bench -np N")
        if args.check:
            code = run_check(_check_context(settings))
            if args.bench:  # the measured ceiling: a short job of ringplug.run.ceiling
                ceiling = [sys.executable, "-m", "ringplug.run.ceiling"]
                code = max(code, _launch(job_from_settings(settings, ceiling), settings,
                                         args.dry_run))  # fmt: skip
            return code
        if not command:
            raise UsageError("no command given; usage: ringrun -np N [options] command [args...]")
        spec = job_from_settings(settings, command)
        return _launch(spec, settings, args.dry_run)
    except (UsageError, SettingsError, HostSpecError, LauncherError) as error:
        print(f"ringrun: error: {error}", file=sys.stderr, flush=True)
        return USAGE_ERROR


def _check_context(settings: RunSettings) -> CheckContext:
    """What ``ringrun --check`` looks at: this machine, and the hosts if any were given."""
    return CheckContext(
        hosts=hosts_from_settings(settings),
        ssh=ssh_from_settings(settings),
        network_interfaces=list(settings.network_interfaces),
        host_timeout_s=settings.effective_start_timeout or DEFAULT_START_TIMEOUT_S,
    )


if __name__ == "__main__":
    sys.exit(main())
