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
import dataclasses
import logging
import math
import os
import secrets
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ringplug import config, wire
from ringplug.forensics.flight import main as explain_flight
from ringplug.run.checks.check import CheckContext, run_check
from ringplug.run.checks.preflight import Preflight, run_preflight
from ringplug.run.configfile import load_config_file
from ringplug.run.horovodrun import TIMELINE_CYCLES_NOTE, add_horovodrun_flags, refusal
from ringplug.run.hosts.spec import (
    Host,
    HostSpecError,
    format_host_list,
    in_batch_allocation,
    launcher_hostfile,
    parse_host_list,
    parse_hostfile,
    rank_hosts,
    total_slots,
)
from ringplug.run.hosts.ssh import DEFAULT_CONNECT_TIMEOUT_S, HostProblem, SshOptions
from ringplug.run.launch import elastic
from ringplug.run.launch.elastic import ElasticError
from ringplug.run.launch.job import START_FAILED_EXIT_CODE, JobResult, StartWatch, run_job
from ringplug.run.launch.mpi import (
    FORWARDED_VARIABLES,
    JobSpec,
    LauncherError,
    MpiLauncher,
    build_plan,
    find_launcher,
    remote_executables,
)
from ringplug.run.launch.stacks import request_stacks
from ringplug.run.launch.status import RankStatus
from ringplug.run.launch.terminal import TERMINAL_VARIABLE, describe_terminal
from ringplug.run.launch.threads import threads_note
from ringplug.run.settings import RunSettings, SettingsError, add_flags, from_flags

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
    add_flags(RunSettings, parser, horovodrun=False)
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
        "--stacks",
        nargs="?",
        const="",
        metavar="PID",
        help="print every rank's Python stacks of a running job, ranks stuck alike once, and "
        "exit; PID is that job's ringrun (default: the only one of this user running here). "
        "SIGUSR1 to a running ringrun prints them in its own output",
    )
    parser.add_argument(
        "--explain",
        nargs="+",
        metavar="FILE",
        help="say where the ranks' collectives parted, from the flight record file a stalled "
        "or failed job printed, and exit",
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


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    """Merge ``--config-file`` (if any) with the flags; flags win."""
    settings = from_flags(RunSettings, args)
    if args.config_file is not None:
        settings = load_config_file(args.config_file).overridden_by(settings)
    settings.validate()
    return settings


# Launcher arguments that place ranks on hosts: with one in --mpi-args, the launcher's own
# hostfile variables are not ringrun's business.
_HOST_ARGUMENTS = frozenset(
    (
        "-f",
        "-hostfile",
        "--hostfile",
        "-machinefile",
        "--machinefile",
        "-hosts",
        "-host",
        "--host",
        "-H",
        "--default-hostfile",
    )
)


def hosts_from_settings(
    settings: RunSettings, environ: Mapping[str, str] | None = None
) -> tuple[list[Host], str | None]:
    """The hosts of ``-H`` or ``--hostfile``, else of the launcher's hostfile variable.

    Returns the hosts (empty for this machine only) and, when they come from a variable
    such as the Kubernetes MPI Operator sets, ``"VARIABLE=path"`` to say so.
    """
    if settings.hosts:
        return parse_host_list(settings.hosts), None
    if settings.hostfile:
        return parse_hostfile(settings.hostfile), None
    environ = os.environ if environ is None else environ
    found = launcher_hostfile(environ)
    if found is None or any(arg.split("=")[0] in _HOST_ARGUMENTS for arg in settings.mpi_args):
        return [], None
    name, path = found
    try:
        hosts = parse_hostfile(path, what=f"the hostfile {name} names,")
    except HostSpecError as error:
        raise HostSpecError(
            f"{error} ({name} is the MPI launcher's hostfile variable; the Kubernetes MPI "
            "Operator sets it in the launcher pod). Give the hosts with -H or --hostfile, "
            f"or unset {name}."
        ) from None
    return hosts, f"{name}={path}"


def _say_hosts_origin(hosts: Sequence[Host], origin: str | None) -> None:
    if origin is not None:
        _say(f"hosts from {origin}: {format_host_list(hosts)}")


def ssh_from_settings(settings: RunSettings) -> SshOptions:
    """ssh options from the settings; ssh's connect timeout stays within the start timeout
    (ssh's own default with no start limit)."""
    limit = settings.host_timeout_s
    connect = DEFAULT_CONNECT_TIMEOUT_S if math.isinf(limit) else math.ceil(limit)
    return SshOptions(
        port=settings.ssh_port,
        identity_file=_absolute(settings.ssh_identity_file),
        config_file=_absolute(settings.ssh_config_file),
        connect_timeout_s=max(1, min(DEFAULT_CONNECT_TIMEOUT_S, connect)),
    )


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().resolve())


def job_from_settings(
    settings: RunSettings, command: list[str], hosts: list[Host] | None = None
) -> JobSpec:
    """Resolve hosts, rank count and paths into a :class:`JobSpec`.

    ``hosts``: the job's hosts when already worked out; by default those of the settings
    (`hosts_from_settings`).
    """
    if hosts is None:
        hosts, _ = hosts_from_settings(settings)
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
    for name, value in settings.rank_variables().items():
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
    level = (config.LOG_LEVEL.given() or ("INFO" if verbose else "WARNING")).upper()
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
) -> list[HostProblem]:
    """Check the hosts and settle the interfaces; the problems that stop the job (reported)."""
    preflight = run_preflight(
        spec.hosts,
        spec.ssh,
        sys.executable,
        timeout_s=settings.host_timeout_s,
        needed_files=remote_executables(launcher),
        requested_interfaces=spec.network_interfaces,
    )
    for warning in preflight.warnings:
        logger.warning("%s", warning)
    if preflight.problems and not dry_run:
        for line in _problem_lines(preflight.problems, spec, "cannot start the job"):
            _say(line)
        _say(
            "these checks ran before any rank started; `ringrun --check -H ...` repeats them "
            "with a full report, and --no-preflight skips them"
        )
        return list(preflight.problems)
    if preflight.problems:
        for problem in preflight.problems:
            logger.warning(
                "%s (a real run would stop here; fix: %s)", problem.describe(), problem.fix
            )
    spec.network = preflight.network_choice()
    if dry_run or settings.verbose:
        for line in _interface_lines(preflight):
            _say(line)
    return []


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


def _problem_lines(problems: Sequence[HostProblem], spec: JobSpec, what: str) -> list[str]:
    """Two lines a problem: what happened on which host (with its ranks), then the fix."""
    placed = rank_hosts(spec.hosts, spec.np) if spec.hosts else []
    lines = []
    for problem in problems:
        ranks = [str(rank) for rank, host in enumerate(placed) if host == problem.host]
        which = f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)})" if ranks else ""
        lines.append(f"{what}: host {problem.host}{which}: {problem.reason}: {problem.detail}")
        lines.append(f"  fix: {problem.fix}")
    return lines


def _fd(stream: object) -> int:
    """The descriptor behind one of ringrun's streams, or -1 (a test's capture has none)."""
    try:
        return stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return -1


def _launch(spec: JobSpec, settings: RunSettings, dry_run: bool) -> int:
    """Check the hosts, build the launch plan and print it, or run it and report the end."""
    return _start(spec, settings, dry_run).exit_code


def _start(spec: JobSpec, settings: RunSettings, dry_run: bool) -> JobResult:
    """`_launch`, returning how the job ended (or that the preflight stopped it)."""
    launcher = find_launcher()
    if launcher is not None and wants_preflight(spec, settings, os.environ):
        problems = _preflight(spec, settings, launcher, dry_run)
        if problems:
            return JobResult(exit_code=START_FAILED_EXIT_CODE, host_problems=problems)
    if dry_run:
        print(build_plan(spec, launcher).shell_line(), flush=True)
        return JobResult(exit_code=0)
    token = secrets.token_hex(8)
    environ = {**os.environ, wire.EVENTS_VARIABLE: token}
    # In a terminal, rank 0's program gets one too (its progress bars draw live); a value
    # inherited from an enclosing job must not leak into a job whose output is a pipe.
    environ.pop(TERMINAL_VARIABLE, None)
    terminal = describe_terminal({"stdout": _fd(sys.stdout), "stderr": _fd(sys.stderr)}, environ)
    if terminal is not None:
        environ[TERMINAL_VARIABLE] = terminal.to_variable()
    plan = build_plan(spec, launcher, environ=environ)
    if settings.verbose:
        _say(plan.shell_line())
    _say_threads(spec, settings)
    result = run_job(
        plan,
        environ=environ,
        events_token=token,
        start_watch=start_watch(spec, settings),
        terminal=terminal,
    )
    for line in verdict_lines(result, spec, settings):
        _say(line)
    if result.exit_code != 0:
        for hint in result.hints:
            _say(f"hint: {hint}")
    return result


def verdict_lines(result: JobResult, spec: JobSpec, settings: RunSettings) -> list[str]:
    """What ringrun says about a job that ended: its one verdict, the cause first."""
    lost = lost_hosts(result, spec)
    if result.stopped_by is not None:
        return ["stopped; all ranks were terminated"]
    if result.not_started:
        return _not_started_lines(result, spec, settings)
    if lost and result.exit_code != 0:
        return _lost_host_lines(lost, result, spec)
    if result.root is not None and not result.root.left_early:
        return _root_cause_lines(result, spec)
    if result.host_problems and result.exit_code != 0:
        return _problem_lines(result.host_problems, spec, "could not start ranks")
    if result.root is not None:
        return _root_cause_lines(result, spec)
    if result.unreported and result.exit_code != 0:
        # Hydra also kills the ranks that started when it cannot start a host's proxy; the
        # hosts with none started are then the cause (under load a rank elsewhere starts
        # before the launcher gives up).
        return [
            f"rank{'s' if len(result.unreported) > 1 else ''} "
            f"{', '.join(map(str, result.unreported))} started but never reported how they "
            "ended: the launcher killed them with their wrappers (hydra does so to every rank "
            "when one leaves without MPI_Finalize, e.g. through os._exit); the launcher exited "
            f"with code {result.launcher_returncode}",
            *_never_started_lines(result, spec),
        ]
    if result.exit_code != 0:
        return [
            f"the launcher exited with code {result.launcher_returncode}",
            *_never_started_lines(result, spec),
        ]
    return []


def _say_threads(spec: JobSpec, settings: RunSettings) -> None:
    """Say once that the ranks get OMP_NUM_THREADS from ringrun, as torchrun says it: to a
    person at a terminal, and in logs with --verbose (the first "ringrun:" line of a piped
    job is its verdict, which scripts read). A bad RINGPLUG_SPLIT_THREADS stops the job."""
    one_host = not spec.hosts or (len(spec.hosts) == 1 and not spec.remote_hosts)
    try:
        note = threads_note(spec.np, one_host, os.environ, spec.env)
    except ValueError as error:  # a RINGPLUG_SPLIT_THREADS that is no switch
        raise UsageError(str(error)) from None
    if note is not None and (settings.verbose or sys.stderr.isatty()):
        _say(f"note: {note}")


def _launch_elastic(settings: RunSettings, command: list[str], hosts: list[Host]) -> int:
    """Run the job, restarting it after a failure with the hosts left (`launch.elastic`)."""
    plan = elastic.plan_from_settings(settings)
    if plan.discovery_script is None and not hosts and plan.max_np is None:
        raise UsageError("say how many ranks to run with -np N (or give hosts with -H)")
    last: list[JobSpec] = []
    # One id for every start, so that a restart finds the commits of the starts before it.
    job_id = os.environ.get(elastic.JOB_ID_VARIABLE) or secrets.token_hex(6)

    def start(start_hosts: list[Host], np: int, restart: int) -> JobResult:
        spec = job_from_settings(dataclasses.replace(settings, np=np), command, start_hosts)
        spec.env[elastic.RESTART_VARIABLE] = str(restart)
        spec.env[elastic.JOB_ID_VARIABLE] = job_id
        last[:] = [spec]
        return _start(spec, settings, dry_run=False)

    def cause(result: JobResult) -> str:
        root, spec = result.root, last[0]
        lost = lost_hosts(result, spec)
        if lost and not _root_elsewhere(result, lost):
            problem, ranks = lost[0]
            return f"host {problem.host} ({_ranks_text(ranks)}) was lost"
        if root is not None and root.status is not None:
            return _describe_failure(root.status, spec)
        if root is not None and root.rank is not None:
            return f"rank {root.rank} stopped taking part"
        if result.host_problems:
            return f"host {result.host_problems[0].host} could not run its ranks"
        return f"the launcher exited with code {result.launcher_returncode}"

    code = elastic.run_elastic(plan, hosts, start, cause, _say)
    if code == 0 and not os.environ.get(elastic.COMMIT_DIR_VARIABLE):
        # The job is done: its commits (hvd.elastic's default place, on this host) are not
        # needed any more. A directory the user named is theirs to keep.
        shutil.rmtree(elastic.default_commit_directory(job_id), ignore_errors=True)
    return code


def lost_hosts(result: JobResult, spec: JobSpec) -> list[tuple[HostProblem, list[int]]]:
    """The hosts lost while the job ran, each with the ranks -H put there.

    A host is lost when ssh said its connection failed (the host went down, or its ssh
    server or the launcher's proxy there was killed) after ranks there had started: the
    launcher then ends the job (hydra kills every rank quietly), and nothing else names the
    host. A host whose ranks never started could not start them, which is another message.
    """
    if not spec.hosts or not result.started:
        return []
    placed = rank_hosts(spec.hosts, spec.np)
    lost = []
    for problem in result.host_problems:
        ranks = [rank for rank, host in enumerate(placed) if host == problem.host]
        if any(rank in result.started for rank in ranks):
            lost.append((problem, ranks))
    return lost


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def _root_elsewhere(result: JobResult, lost: Sequence[tuple[HostProblem, list[int]]]) -> bool:
    """Whether a rank on a host that was not lost failed on its own (an exception) first:
    then it is the cause, and the lost connections came after."""
    root = result.root
    on_lost = {rank for _, ranks in lost for rank in ranks}
    return (
        root is not None
        and root.status is not None
        and not root.left_early
        and root.rank not in on_lost
    )


def _lost_host_lines(
    lost: Sequence[tuple[HostProblem, list[int]]], result: JobResult, spec: JobSpec
) -> list[str]:
    """Each lost host with its ranks and what ssh said; a failure elsewhere first if any."""
    lines = _root_cause_lines(result, spec) if _root_elsewhere(result, lost) else []
    for problem, ranks in lost:
        lines.append(
            f"host {problem.host} ({_ranks_text(ranks)}) was lost while the job ran: "
            f"{problem.detail}, and the launcher ended the job"
        )
    names = ", ".join(problem.host for problem, _ in lost)
    lines.append(
        f"  the host went down, or its ssh server or the launcher's proxy there was killed; "
        f"`ringrun --check -H {names}` says whether it is back"
    )
    return lines


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
    if args.stacks is not None:
        return request_stacks(args.stacks or None)
    if args.explain:
        return explain_flight(args.explain)
    if args.timeline_mark_cycles:
        print(f"ringrun: note: {TIMELINE_CYCLES_NOTE}", file=sys.stderr, flush=True)
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    _configure_logging(bool(args.verbose))
    try:
        settings = settings_from_args(args)
        hosts, origin = hosts_from_settings(settings)
        if args.bench and not args.check:
            raise UsageError("--bench goes with --check: ringrun --check --bench -np N")
        if args.check:
            _say_hosts_origin(hosts, origin)
            code = run_check(_check_context(settings, hosts))
            if args.bench:  # the measured ceiling: a short job of ringplug.run.checks.ceiling
                ceiling = [sys.executable, "-m", "ringplug.run.checks.ceiling"]
                spec = job_from_settings(settings, ceiling, hosts)
                code = max(code, _launch(spec, settings, args.dry_run))
            return code
        if not command:
            raise UsageError("no command given; usage: ringrun -np N [options] command [args...]")
        if settings.elastic and not args.dry_run:
            _say_hosts_origin(hosts, origin)
            return _launch_elastic(settings, command, hosts)
        spec = job_from_settings(settings, command, hosts)
        if args.dry_run or settings.verbose:
            _say_hosts_origin(hosts, origin)
        return _launch(spec, settings, args.dry_run)
    except (UsageError, SettingsError, HostSpecError, LauncherError, ElasticError) as error:
        print(f"ringrun: error: {error}", file=sys.stderr, flush=True)
        return USAGE_ERROR


def _check_context(settings: RunSettings, hosts: list[Host]) -> CheckContext:
    """What ``ringrun --check`` looks at: this machine, and the hosts if any were given."""
    return CheckContext(
        hosts=hosts,
        ssh=ssh_from_settings(settings),
        network_interfaces=list(settings.network_interfaces),
        host_timeout_s=settings.host_timeout_s,
    )


if __name__ == "__main__":
    sys.exit(main())
