"""Launch settings for ``ringrun``: one dataclass shared by the command line and config files."""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


class SettingsError(ValueError):
    """A setting with a value ``ringrun`` cannot use."""


# Variables the launcher and ringrun set for every rank: a value from -x would break the
# job (ranks that do not know who they are, or whose reports ringrun cannot read).
INTERNAL_PREFIXES = ("RINGPLUG_RUN_", "PMI_", "PMIX_", "OMPI_COMM_WORLD_")
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


@dataclass
class RunSettings:
    """Everything that shapes a launch, whether it came from flags or ``--config-file``.

    Every field is also a config-file key of the same name. A field left at its default
    (``None`` or empty) means "not given", so the command line can override a file field by
    field. Later features add fields here; the config file picks them up by itself.

    Args:
        np: number of ranks. Defaults to ``None``: the total slots of ``hosts``, else required.
        hosts: ``"a:2,b:2"`` or ``["a:2", "b:2"]``. Defaults to ``None`` (this machine).
        hostfile: path of a hostfile. Defaults to ``None``.
        network_interfaces: NICs for MPI traffic, e.g. ``["eth0"]``. Defaults to ``[]``.
        ssh_port: port for ssh to remote hosts. Defaults to ``None`` (ssh's own default).
        ssh_identity_file: private key for ssh to remote hosts. Defaults to ``None``
            (ssh's own choice).
        ssh_config_file: ssh configuration file to use instead of ``~/.ssh/config``.
            Defaults to ``None``.
        env: variables for the ranks; a ``None`` value forwards ringrun's own value.
            Defaults to ``{}``.
        output_filename: directory for per-rank ``stdout``/``stderr`` copies. Defaults to
            ``None`` (terminal only).
        bind_to: ``"none"``, ``"core"`` or ``"socket"``. Defaults to ``None`` (launcher's
            default).
        verbose: print the launcher command line before running it. Defaults to ``False``.
        timeline: path of the engine's Chrome trace (sets ``RINGPLUG_TIMELINE`` for the
            ranks; rank 0 writes it). Defaults to ``None`` (no timeline).
        mpi_args: extra arguments for the MPI launcher, placed before the per-rank
            command; a string is split like a shell would. Defaults to ``[]``.
        start_timeout: seconds within which every rank, on every host, must have started
            its program (before the program's imports), or ringrun stops the job; ``0``
            means no limit. Defaults to ``None`` (60 s, :data:`DEFAULT_START_TIMEOUT_S`).
        preflight: ``False`` skips the check of remote hosts (ssh, Python, versions,
            interfaces) before a multi-host job. Defaults to ``None`` (check).
        log_level: ringplug's log level on the ranks (``RINGPLUG_LOG_LEVEL``): one of
            TRACE, DEBUG, INFO, WARNING, ERROR, FATAL or CRITICAL. Defaults to ``None``
            (ringplug's own default, WARNING).
        fusion_threshold_mb: MiB of allreduce tensors fused into one buffer
            (``RINGPLUG_FUSION_THRESHOLD``; 0 turns fusion off). Defaults to ``None`` (64).
        cycle_time_ms: milliseconds the engine waits for more requests to fuse
            (``RINGPLUG_CYCLE_TIME``). Defaults to ``None`` (0).
        stall_check: ``False`` turns off the stall warning and shutdown. Defaults to
            ``None`` (on).
        stall_check_warning_time_seconds: seconds before rank 0 warns about collectives
            some ranks never submitted (``RINGPLUG_STALL_CHECK_SECONDS``). Defaults to
            ``None`` (60).
        stall_check_shutdown_time_seconds: seconds before such a stall ends the job
            (``RINGPLUG_STALL_SHUTDOWN_SECONDS``; 0 never). Defaults to ``None`` (0).
    """

    np: int | None = None
    hosts: str | list[str] | None = None
    hostfile: str | None = None
    network_interfaces: list[str] = field(default_factory=list)
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_config_file: str | None = None
    env: dict[str, str | None] = field(default_factory=dict)
    output_filename: str | None = None
    bind_to: str | None = None
    verbose: bool = False
    timeline: str | None = None
    mpi_args: list[str] = field(default_factory=list)
    start_timeout: float | None = None
    preflight: bool | None = None
    log_level: str | None = None
    fusion_threshold_mb: int | None = None
    cycle_time_ms: float | None = None
    stall_check: bool | None = None
    stall_check_warning_time_seconds: float | None = None
    stall_check_shutdown_time_seconds: float | None = None

    @classmethod
    def keys(cls) -> list[str]:
        """Names accepted as config-file keys, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> RunSettings:
        """Build settings from a parsed config file, checking keys and value types.

        Raises:
            SettingsError: for an unknown key or a value of the wrong type; the message
                names ``source``, the key and what was expected.
        """
        allowed = cls.keys()
        unknown = [key for key in values if key not in allowed]
        if unknown:
            raise SettingsError(
                f"{source}: unknown setting {unknown[0]!r}. Allowed settings: {', '.join(allowed)}."
            )
        checked: dict[str, Any] = {}
        for key, value in values.items():
            checked[key] = _check_value(key, value, source)
        return cls(**checked)

    def overridden_by(self, other: RunSettings) -> RunSettings:
        """These settings with every field that ``other`` sets taking precedence.

        ``env`` is merged key by key (``other`` wins on clashes); other fields are replaced
        whole when ``other`` gives them.
        """
        changes: dict[str, Any] = {}
        defaults = RunSettings()
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "env":
                changes["env"] = {**mine, **theirs}
            elif theirs != getattr(defaults, f.name):
                changes[f.name] = theirs
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Check the combination of settings, after config file and flags are merged."""
        if self.hosts and self.hostfile:
            raise SettingsError("give hosts (-H) or a hostfile (--hostfile), not both")
        if self.np is not None and self.np < 1:
            raise SettingsError(f"-np must be at least 1, got {self.np}")
        if self.bind_to is not None and self.bind_to not in BIND_CHOICES:
            raise SettingsError(
                f"bind_to must be one of {', '.join(BIND_CHOICES)}, got {self.bind_to!r}"
            )
        if self.ssh_port is not None and not 0 < self.ssh_port < 65536:
            raise SettingsError(f"ssh_port must be between 1 and 65535, got {self.ssh_port}")
        if self.start_timeout is not None and not 0 <= self.start_timeout < math.inf:
            raise SettingsError(
                "start_timeout must be a finite number of seconds, or 0 for no limit, got "
                f"{self.start_timeout}"
            )
        if self.log_level is not None and self.log_level.upper() not in LOG_LEVELS:
            raise SettingsError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.fusion_threshold_mb is not None and self.fusion_threshold_mb < 0:
            raise SettingsError(
                f"fusion_threshold_mb must be 0 (no fusion) or more, got {self.fusion_threshold_mb}"
            )
        if self.cycle_time_ms is not None and not 0 <= self.cycle_time_ms <= 1000:
            raise SettingsError(
                "cycle_time_ms (--cycle-time-ms) must be between 0 and 1000 milliseconds, got "
                f"{self.cycle_time_ms}"
            )
        warning = self.stall_check_warning_time_seconds
        shutdown = self.stall_check_shutdown_time_seconds
        if warning is not None and not 0 < warning < math.inf:
            raise SettingsError(
                "stall_check_warning_time_seconds must be a positive, finite number of seconds, "
                f"got {warning}; turn the stall check off with --no-stall-check instead"
            )
        if shutdown is not None and not 0 <= shutdown < math.inf:
            raise SettingsError(
                "stall_check_shutdown_time_seconds must be 0 (never) or a finite number of "
                f"seconds, got {shutdown}"
            )
        for name in self.env:
            check_variable_name(name, "-x / env")
        if self.stall_check is False and (warning is not None or shutdown is not None):
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

    def rank_variables(self) -> dict[str, str]:
        """The ``RINGPLUG_*`` values for the ranks that the tuning settings ask for.

        The names and units are those :mod:`ringplug.core.config` reads.
        """
        values: dict[str, str] = {}
        if self.log_level is not None:
            values["RINGPLUG_LOG_LEVEL"] = LOG_LEVELS[self.log_level.upper()]
        if self.fusion_threshold_mb is not None:
            values["RINGPLUG_FUSION_THRESHOLD"] = f"{self.fusion_threshold_mb}M"
        if self.cycle_time_ms is not None:
            values["RINGPLUG_CYCLE_TIME"] = f"{self.cycle_time_ms:g}"
        if self.stall_check is False:
            # ringplug has no off switch (0 is refused); a warning time of infinity never
            # comes, and a shutdown time of 0 means never.
            values["RINGPLUG_STALL_CHECK_SECONDS"] = "inf"
            values["RINGPLUG_STALL_SHUTDOWN_SECONDS"] = "0"
        if self.stall_check_warning_time_seconds is not None:
            values["RINGPLUG_STALL_CHECK_SECONDS"] = f"{self.stall_check_warning_time_seconds:g}"
        if self.stall_check_shutdown_time_seconds is not None:
            seconds = self.stall_check_shutdown_time_seconds
            values["RINGPLUG_STALL_SHUTDOWN_SECONDS"] = f"{seconds:g}"
        return values


def _check_value(key: str, value: Any, source: str) -> Any:
    """Return ``value`` in the type field ``key`` wants, or raise naming what was expected."""

    def wrong(expected: str) -> SettingsError:
        return SettingsError(f"{source}: {key} must be {expected}, got {value!r}")

    # bool is an int subclass; `np: true` is a mistake worth catching.
    if key in ("np", "ssh_port", "fusion_threshold_mb"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("a whole number")
        return value
    if key in (
        "start_timeout",
        "cycle_time_ms",
        "stall_check_warning_time_seconds",
        "stall_check_shutdown_time_seconds",
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise wrong("a number")
        return float(value)
    if key == "mpi_args":
        if isinstance(value, str):
            try:
                return shlex.split(value)
            except ValueError as error:
                raise wrong(f"arguments a shell can split ({error})") from None
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return list(value)
        raise wrong("a string of arguments or a list of them")
    if key in ("verbose", "stall_check", "preflight"):
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if key == "hosts":
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return list(value)
        raise wrong("a string like 'a:2,b:2' or a list of 'host:slots' strings")
    if key == "network_interfaces":
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return list(value)
        raise wrong("a list of interface names")
    if key == "env":
        if not isinstance(value, Mapping):
            raise wrong("a mapping of variable names to values")
        env: dict[str, str | None] = {}
        for name, item in value.items():
            if isinstance(item, (dict, list)):
                raise SettingsError(f"{source}: env.{name} must be a plain value, got {item!r}")
            # YAML and TOML give numbers and booleans their own types; the ranks see text.
            if isinstance(item, bool):
                item = "1" if item else "0"
            env[str(name)] = None if item is None else str(item)
        return env
    if key in (
        "hostfile",
        "output_filename",
        "bind_to",
        "timeline",
        "log_level",
        "ssh_identity_file",
        "ssh_config_file",
    ):
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    return value
