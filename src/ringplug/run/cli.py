"""The ``ringrun`` command: start N ranks of a program through the installed MPI launcher.

Example::

    ringrun -np 4 python train.py
    ringrun -np 4 -H node1:2,node2:2 --network-interface eth0 python train.py
    ringrun -np 2 --dry-run python train.py     # print the mpiexec line, run nothing
    ringrun --check                             # what MPI and frameworks ranks would use

horovodrun's flags are accepted too (see :mod:`ringplug.run.horovodrun`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ringplug.run.check import run_check
from ringplug.run.configfile import load_config_file
from ringplug.run.horovodrun import TIMELINE_CYCLES_NOTE, add_horovodrun_flags, refusal
from ringplug.run.hosts import (
    Host,
    HostSpecError,
    parse_host_list,
    parse_hostfile,
    rank_hosts,
    ranks_on_this_machine,
    total_slots,
)
from ringplug.run.launcher import JobResult, StartWatch, run_job
from ringplug.run.mpi import JobSpec, LauncherError, build_plan, find_launcher
from ringplug.run.settings import BIND_CHOICES, RunSettings, SettingsError
from ringplug.run.status import START_MARKERS_VARIABLE, STATUS_DIR_VARIABLE

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
        help="network interface for MPI and NCCL traffic (repeatable)",
    )
    parser.add_argument(
        "-p",
        "--ssh-port",
        type=int,
        metavar="PORT",
        help="ssh port for starting ranks on remote hosts",
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
        help="report Python, MPI and framework setup, with warnings, and exit",
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
        env=_parse_env_flags(args.env or []),
        output_filename=args.output_filename,
        bind_to=args.bind_to,
        verbose=bool(args.verbose),
        timeline=args.timeline,
        mpi_args=_split_mpi_args(args.mpi_args or []),
        start_timeout=args.start_timeout,
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


def job_from_settings(settings: RunSettings, command: list[str]) -> JobSpec:
    """Resolve hosts, rank count and paths into a :class:`JobSpec`."""
    hosts: list[Host] = []
    if settings.hosts:
        hosts = parse_host_list(settings.hosts)
    elif settings.hostfile:
        hosts = parse_hostfile(settings.hostfile)
    np = settings.np
    if np is None:
        if not hosts:
            raise UsageError("say how many ranks to run with -np N (or give hosts with -H)")
        np = total_slots(hosts)
    env = dict(settings.env)
    if settings.timeline is not None:
        # Absolute, so rank 0 writes it where the user asked whatever its working directory.
        env["RINGPLUG_TIMELINE"] = str(Path(settings.timeline).resolve())
    for name, value in settings.rank_variables().items():
        if env.get(name, value) != value:
            logger.warning(
                "%s=%s from the tuning settings replaces %s=%s from -x or the config file's env",
                name,
                value,
                name,
                env[name],
            )
        env[name] = value
    output_dir = None
    if settings.output_filename is not None:
        # Absolute, so ranks find it whatever their working directory.
        output_dir = str(Path(settings.output_filename).resolve())
    return JobSpec(
        np=np,
        command=command,
        hosts=hosts,
        network_interfaces=list(settings.network_interfaces),
        ssh_port=settings.ssh_port,
        env=env,
        output_dir=output_dir,
        bind_to=settings.bind_to,
        mpi_args=list(settings.mpi_args),
    )


def start_watch(spec: JobSpec, timeout_s: float, environ: dict[str, str]) -> StartWatch | None:
    """Which ranks ``--start-timeout`` can watch: those on this machine.

    Ranks elsewhere cannot write into ringrun's status directory, which exists only here.
    """
    local = ranks_on_this_machine(spec.hosts, spec.np, environ)
    if local is None:
        logger.warning(
            "--start-timeout is ignored: inside a batch allocation without -H or --hostfile, "
            "ringrun cannot tell which ranks start on this machine; give the hosts to use it"
        )
        return None
    if len(local) < spec.np:
        logger.warning(
            "--start-timeout watches only the %d rank(s) on this machine; ranks on other "
            "hosts cannot report to ringrun",
            len(local),
        )
    if not local:
        return None
    return StartWatch(timeout_s=timeout_s, ranks=frozenset(local))


def _configure_logging(verbose: bool) -> None:
    """ringrun's own messages go to stderr, prefixed so they stand out from rank output."""
    level = os.environ.get("RINGPLUG_LOG_LEVEL", "INFO" if verbose else "WARNING").upper()
    logging.basicConfig(format="ringrun: %(message)s", level=level, stream=sys.stderr)


def _launch(spec: JobSpec, settings: RunSettings, dry_run: bool) -> int:
    """Build the launch plan and print it, or run it and report how the job ended."""
    launcher = find_launcher()
    if dry_run:
        print(build_plan(spec, launcher).shell_line(), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="ringrun-status-") as status_dir:
        environ = {**os.environ, STATUS_DIR_VARIABLE: status_dir}
        watch = None
        if settings.start_timeout is not None:
            watch = start_watch(spec, settings.start_timeout, environ)
        if watch is not None:
            environ[START_MARKERS_VARIABLE] = "1"
        plan = build_plan(spec, launcher, environ=environ)
        if settings.verbose:
            print(f"ringrun: {plan.shell_line()}", file=sys.stderr, flush=True)
        result = run_job(plan, environ=environ, status_dir=status_dir, start_watch=watch)
    if result.stopped_by is not None:
        print("ringrun: stopped; all ranks were terminated", file=sys.stderr, flush=True)
    elif result.not_started:
        for line in _not_started_lines(result, spec, settings):
            print(f"ringrun: {line}", file=sys.stderr, flush=True)
    elif result.first_failure is not None:
        print(f"ringrun: {result.first_failure.describe()}", file=sys.stderr, flush=True)
        if len(result.failures) > 1:
            print(
                f"ringrun: {len(result.failures) - 1} more rank(s) failed after it, most "
                "likely stopped by the teardown",
                file=sys.stderr,
                flush=True,
            )
    elif result.exit_code != 0:
        print(
            f"ringrun: the launcher exited with code {result.launcher_returncode}",
            file=sys.stderr,
            flush=True,
        )
    return result.exit_code


def _not_started_lines(result: JobResult, spec: JobSpec, settings: RunSettings) -> list[str]:
    """What to tell the user when ranks did not start their program in time."""
    placed = rank_hosts(spec.hosts, spec.np) if spec.hosts else []
    by_host: dict[str, list[str]] = {}
    for rank in result.not_started:
        host = placed[rank] if placed else socket.gethostname()
        by_host.setdefault(host, []).append(str(rank))
    where = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)} on host {host}"
        for host, ranks in by_host.items()
    )
    return [
        f"{where} did not start the program within {settings.start_timeout:g} s "
        f"(--start-timeout), so ringrun stopped the job",
        "check that the hosts are reachable and `ssh HOST true` works there without a "
        "password, that the MPI library the ranks load belongs to the launcher (ringrun "
        "--check), and that nothing slow runs before the program starts; or give a longer "
        "--start-timeout",
    ]


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
    if args.check:
        return run_check()
    try:
        settings = settings_from_args(args)
        if not command:
            raise UsageError("no command given; usage: ringrun -np N [options] command [args...]")
        spec = job_from_settings(settings, command)
        return _launch(spec, settings, args.dry_run)
    except (UsageError, SettingsError, HostSpecError, LauncherError) as error:
        print(f"ringrun: error: {error}", file=sys.stderr, flush=True)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
