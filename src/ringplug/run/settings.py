"""Launch settings for ``ringrun``: each declared once, as a field of :class:`RunSettings`.

A field's declaration (:func:`~ringplug.run.setting.setting`) gives its type and default,
its flags (ringrun's and horovodrun's spellings), its config-file key (the field's name),
the check of its value and the ``RINGPLUG_*`` variables it sets for the ranks. The parser,
the config file, the merge, the validation and ``--dry-run`` read those declarations (see
:mod:`ringplug.run.setting`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringplug._ground import config, wire
from ringplug.run import setting as declared
from ringplug.run.setting import (
    ARGUMENTS,
    HOSTS,
    NAMES,
    NUMBER,
    SWITCH,
    TEXT,
    VARIABLES,
    WHOLE,
    Flag,
    SettingsError,
    one_of,
    setting,
    with_flagged_variables,
    within,
)

BIND_CHOICES = ("none", "core", "socket")

DEFAULT_START_TIMEOUT_S = 60.0
"""Seconds every rank gets to start its program when ``start_timeout`` is not given."""

# horovodrun's log levels (and Python's CRITICAL) -> the Python logging names that
# RINGPLUG_LOG_LEVEL takes; Python logging has no TRACE, and FATAL is its CRITICAL.
LOG_LEVELS = {
    "TRACE": "DEBUG",
    "DEBUG": "DEBUG",
    "INFO": "INFO",
    "WARNING": "WARNING",
    "ERROR": "ERROR",
    "FATAL": "CRITICAL",
    "CRITICAL": "CRITICAL",
}


INTERNAL_PREFIXES = wire.INTERNAL_PREFIXES
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Hostfiles and config files are short text files.
TEXT_FILE_LIMIT = 1 << 20


def read_text_file(path: str | Path, what: str, error: type[Exception] = SettingsError) -> str:
    """The text of a small UTF-8 file such as a hostfile, or `error` saying what is wrong.

    A device (``/dev/zero``), a directory, a binary file or one over 1 MiB is refused
    before it is read whole.
    """
    path = Path(path)
    try:
        if not path.is_file():
            kind = "does not exist" if not path.exists() else "is not a regular file"
            raise error(f"{what} {path} {kind}; give the path of a text file")
        with path.open("rb") as file:
            data = file.read(TEXT_FILE_LIMIT + 1)
    except OSError as problem:
        raise error(f"cannot read {what} {path}: {problem.strerror}") from None
    if len(data) > TEXT_FILE_LIMIT:
        raise error(f"{what} {path} is larger than 1 MiB; it should be a short text file")
    if b"\0" in data:
        raise error(f"{what} {path} is not a text file (it holds NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as problem:
        raise error(
            f"{what} {path} is not UTF-8 text (byte {problem.start} cannot be read)"
        ) from None


def check_variable_name(name: str, where: str) -> None:
    """Refuse a name that is no environment variable, or one ringrun or the launcher sets."""
    if not _VARIABLE_NAME.fullmatch(name):
        raise SettingsError(
            f"{where}: {name!r} is not a variable name (letters, digits and _, not first a digit)"
        )
    if name.startswith(INTERNAL_PREFIXES):
        raise SettingsError(
            f"{where}: {name} is set by ringrun or the MPI launcher for every rank (names "
            f"starting {', '.join(INTERNAL_PREFIXES)}); setting it would break the job. "
            "Leave it out."
        )


def _check_variable_names(env: dict[str, str | None]) -> None:
    for name in env:
        check_variable_name(name, "-x / env")


def _stall_check_variables(on: bool) -> dict[str, str]:
    # ringplug has no off switch (0 is refused); a warning time of infinity never comes,
    # and a shutdown time of 0 means never.
    if on:
        return {}
    return {config.STALL_CHECK_SECONDS.name: "inf", config.STALL_SHUTDOWN_SECONDS.name: "0"}


def _mib(count: int) -> str:
    return f"{count >> 20:g}" if count % (1 << 20) == 0 else f"{count / (1 << 20):g}"


@dataclass
@with_flagged_variables
class RunSettings:
    """Everything that shapes a launch, whether it came from flags or ``--config-file``.

    Each field is one setting, declared whole where it is defined: its help says what it
    means and its default. A field at its default (``None`` or empty) means "not given",
    so the command line overrides a config file field by field.

    Besides these, each ``RINGPLUG_*`` variable declared with a flag in ``core.config``
    (``--timeout``, ``--timeline``) is a setting of its own (:func:`with_flagged_variables`).
    """

    np: int | None = setting(
        WHOLE,
        "number of ranks (default: total slots of -H/--hostfile)",
        flags=("-np", "-n", "--num-proc"),
        metavar="N",
        check=within("-np must be at least 1, got {value}", low=1),
    )
    hosts: str | list[str] | None = setting(
        HOSTS,
        "hosts and their slot counts, e.g. node1:2,node2:2; ranks fill each host before the next",
        flags=[Flag(("-H", "--hosts"), exclusive="hosts")],
        metavar="HOST:SLOTS,...",
        replaces=("hostfile",),
    )
    hostfile: str | None = setting(
        TEXT,
        "file with one 'host:slots', 'host slots=N' or 'host' per line",
        flags=[
            Flag(("--hostfile",), exclusive="hosts"),
            Flag(("-hostfile",), horovodrun=True, help="same as --hostfile"),
        ],
        metavar="FILE",
        replaces=("hosts",),
    )
    network_interfaces: list[str] = setting(
        NAMES,
        "network interface for MPI and NCCL traffic (repeatable; each host uses the names it "
        "has). Default on several hosts: the interfaces that the preflight finds routing "
        "between all of them",
        flags=[
            Flag(("--network-interface",)),
            Flag(
                ("--network-interfaces",),
                horovodrun=True,
                split=True,
                metavar="IF,IF",
                help="network interfaces as one comma-separated list (adds to --network-interface)",
            ),
        ],
        default_factory=list,
        metavar="IF",
    )
    ssh_port: int | None = setting(
        WHOLE,
        "ssh port for starting ranks on remote hosts",
        flags=("-p", "--ssh-port"),
        metavar="PORT",
        check=within("ssh_port must be between 1 and 65535, got {value}", above=0, below=65536),
    )
    ssh_identity_file: str | None = setting(
        TEXT,
        "ssh private key for starting ranks on remote hosts",
        flags=("-i", "--ssh-identity-file"),
        metavar="FILE",
    )
    ssh_config_file: str | None = setting(
        TEXT,
        "ssh configuration file to use instead of ~/.ssh/config (ports, keys, known_hosts "
        "per host)",
        flags=("--ssh-config-file",),
        metavar="FILE",
    )
    env: dict[str, str | None] = setting(
        VARIABLES,
        "environment variable for the ranks: VAR=VALUE sets it, VAR passes ringrun's own "
        "value (repeatable)",
        flags=("-x",),
        default_factory=dict,
        metavar="VAR[=VALUE]",
        check=_check_variable_names,
    )
    output_filename: str | None = setting(
        TEXT,
        "also write each rank's stdout/stderr to DIR/rank.<rank>/",
        flags=("--output-filename",),
        metavar="DIR",
    )
    bind_to: str | None = setting(
        TEXT,
        "pin each rank to a core or socket (default: the launcher's)",
        flags=[Flag(("--bind-to",), choices=BIND_CHOICES)],
        check=one_of("bind_to", BIND_CHOICES),
    )
    verbose: bool = setting(
        SWITCH,
        "print the launcher command line before running it",
        flags=[Flag(("--verbose",), sets=True)],
        default=False,
    )
    mpi_args: list[str] = setting(
        ARGUMENTS,
        "extra arguments for mpiexec/mpirun, placed before the program; write "
        "--mpi-args=-flag for a lone flag",
        horovodrun=("--mpi-args",),
        default_factory=list,
        metavar='"ARGS"',
    )
    start_timeout: float | None = setting(
        NUMBER,
        "stop the job if a rank, on any host, has not started its program SECONDS after "
        f"launch (default {DEFAULT_START_TIMEOUT_S:g}; 0: no limit)",
        horovodrun=("--start-timeout",),
        metavar="SECONDS",
        check=within(
            "start_timeout must be a finite number of seconds, or 0 for no limit, got {value}",
            low=0,
            below=math.inf,
        ),
    )
    preflight: bool | None = setting(
        SWITCH,
        "do not check the hosts (ssh, Python, versions, interfaces) before a job on several hosts",
        flags=[Flag(("--no-preflight",), sets=False)],
    )
    log_level: str | None = setting(
        TEXT,
        f"ringplug's log level on the ranks ({config.LOG_LEVEL.name}): TRACE (means DEBUG), "
        "DEBUG, INFO, WARNING, ERROR or FATAL (means CRITICAL); default "
        f"{config.LOG_LEVEL.default_text}",
        flags=[
            Flag(
                ("--log-level",),
                horovodrun=True,
                normalize=str.upper,
                choices=tuple(level for level in LOG_LEVELS if level != "CRITICAL"),
            )
        ],
        metavar="LEVEL",
        check=one_of("log_level", tuple(LOG_LEVELS), normalize=str.upper),
        ranks=lambda level: {config.LOG_LEVEL.name: LOG_LEVELS[level.upper()]},
    )
    fusion_threshold_mb: int | None = setting(
        WHOLE,
        "fuse allreduce tensors into buffers of up to MB MiB "
        f"({config.FUSION_THRESHOLD.name}; 0: no fusion; default "
        f"{_mib(config.FUSION_THRESHOLD.default)})",
        horovodrun=("--fusion-threshold-mb",),
        metavar="MB",
        ranks=lambda mb: {config.FUSION_THRESHOLD.name: f"{mb}M"},
    )
    cycle_time_ms: float | None = setting(
        NUMBER,
        "let the engine wait MS ms for more tensors to fuse "
        f"({config.CYCLE_TIME.name}; default {config.CYCLE_TIME.default_text})",
        horovodrun=("--cycle-time-ms",),
        metavar="MS",
        ranks=lambda ms: {config.CYCLE_TIME.name: f"{ms:g}"},
    )
    stall_check: bool | None = setting(
        SWITCH,
        "turn off the stall warning and the stall shutdown",
        flags=[Flag(("--no-stall-check",), horovodrun=True, sets=False)],
        ranks=_stall_check_variables,
    )
    stall_check_warning_time_seconds: float | None = setting(
        NUMBER,
        "warn when some ranks have not submitted a collective after S s "
        f"({config.STALL_CHECK_SECONDS.name}; default {config.STALL_CHECK_SECONDS.default_text})",
        horovodrun=("--stall-check-warning-time-seconds",),
        metavar="S",
        check=within(
            "stall_check_warning_time_seconds must be a positive, finite number of seconds, "
            "got {value}; turn the stall check off with --no-stall-check instead",
            above=0,
            below=math.inf,
        ),
        ranks=lambda seconds: {config.STALL_CHECK_SECONDS.name: f"{seconds:g}"},
    )
    stall_check_shutdown_time_seconds: float | None = setting(
        NUMBER,
        f"end the job when such a stall lasts S s ({config.STALL_SHUTDOWN_SECONDS.name}; "
        f"default {config.STALL_SHUTDOWN_SECONDS.default_text})".replace("`", ""),
        horovodrun=("--stall-check-shutdown-time-seconds",),
        metavar="S",
        ranks=lambda seconds: {config.STALL_SHUTDOWN_SECONDS.name: f"{seconds:g}"},
    )

    max_restarts: int | None = setting(
        WHOLE,
        "elastic: start the job again, up to N times, when a rank or host fails (the ranks "
        f"read which start they are in from {wire.RESTART_VARIABLE}); default 0, or 3 when another "
        "elastic flag is given",
        flags=("--max-restarts",),
        horovodrun=("--reset-limit",),
        metavar="N",
        check=within("max_restarts must be 0 or more, got {value}", low=0),
    )
    min_np: int | None = setting(
        WHOLE,
        "elastic: the fewest ranks a restarted job may run with; fewer slots left ends the "
        "job (default: -np, or 1 with a discovery script)",
        horovodrun=("--min-np", "--min-num-proc"),
        metavar="N",
        check=within("min_np must be at least 1, got {value}", low=1),
    )
    max_np: int | None = setting(
        WHOLE,
        "elastic: the most ranks a (re)started job runs with, however many slots the hosts "
        "offer (default: -np, else every slot)",
        horovodrun=("--max-np", "--max-num-proc"),
        metavar="N",
        check=within("max_np must be at least 1, got {value}", low=1),
    )
    host_discovery_script: str | None = setting(
        TEXT,
        "elastic: a program that prints the hosts available now, one 'host' or 'host:slots' "
        "a line; run before every start (within --elastic-timeout)",
        horovodrun=("--host-discovery-script",),
        metavar="FILE",
    )
    slots_per_host: int | None = setting(
        WHOLE,
        "elastic: slots of a host the discovery script names without a count (default 1)",
        horovodrun=("--slots-per-host",),
        metavar="N",
        check=within("slots_per_host must be at least 1, got {value}", low=1),
    )
    elastic_timeout: float | None = setting(
        NUMBER,
        "elastic: how long to wait, asking the discovery script every second, for enough "
        "slots for --min-np ranks (default 600)",
        horovodrun=("--elastic-timeout",),
        metavar="SECONDS",
        check=within(
            "elastic_timeout must be a finite number of seconds, got {value}", low=0, below=math.inf
        ),
    )

    @property
    def elastic(self) -> bool:
        """Whether any elastic setting was given (the job restarts after a failure)."""
        return any(
            value is not None
            for value in (
                self.max_restarts,
                self.min_np,
                self.max_np,
                self.host_discovery_script,
                self.slots_per_host,
                self.elastic_timeout,
            )
        )

    @classmethod
    def keys(cls) -> list[str]:
        """Names accepted as config-file keys, in declaration order."""
        return [name for name, _ in declared.declarations(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> RunSettings:
        """Build settings from a parsed config file, checking keys and value types.

        Raises:
            SettingsError: for an unknown key or a value of the wrong type; the message
                names ``source``, the key and what was expected.
        """
        return declared.from_mapping(cls, values, source)

    def overridden_by(self, other: RunSettings) -> RunSettings:
        """These settings with every field that ``other`` sets taking precedence.

        ``env`` is merged key by key (``other`` wins on clashes); other fields are replaced
        whole when ``other`` gives them, and ``-H`` / ``--hostfile`` replace each other.
        """
        return declared.overridden(self, other)

    def validate(self) -> None:
        """Check each setting, then their combinations, after config file and flags merge."""
        if self.hosts and self.hostfile:
            raise SettingsError("give hosts (-H) or a hostfile (--hostfile), not both")
        declared.check_values(self)
        timed = (
            self.stall_check_warning_time_seconds is not None
            or self.stall_check_shutdown_time_seconds is not None
        )
        if self.stall_check is False and timed:
            raise SettingsError(
                "the stall check is turned off (--no-stall-check), so its warning and shutdown "
                "times would do nothing; give one or the other"
            )

    @property
    def effective_start_timeout(self) -> float | None:
        """The start limit in seconds, ``None`` for none (``start_timeout: 0``)."""
        if self.start_timeout is None:
            return DEFAULT_START_TIMEOUT_S
        return self.start_timeout or None

    @property
    def host_timeout_s(self) -> float:
        """How long each host gets to answer the preflight and ``--check``: the start limit,
        ``math.inf`` when there is none (0 means no limit here too, not the default)."""
        limit = self.effective_start_timeout
        return math.inf if limit is None else limit

    def rank_variables(self) -> dict[str, str]:
        """The ``RINGPLUG_*`` values for the ranks that the settings ask for.

        The names and units are those :mod:`ringplug.core.config` reads.
        """
        return declared.rank_variables(self)
