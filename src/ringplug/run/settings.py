"""Launch settings for ``ringrun``: each declared once, as a field of :class:`RunSettings`.

A field is made by :func:`setting`: its kind (how a config file writes it and a flag parses
it, a :class:`SettingKind`), its help, its flags (ringrun's and horovodrun's spellings), the
check of its value and the ``RINGPLUG_*`` variables it gives the ranks; the field's name is
its config-file key. From those declarations come the command line (:func:`add_flags`), the
config file (:func:`from_mapping`), the merge of flags over a file (:func:`from_flags`,
:func:`overridden`), the validation (:func:`check_values`) and what reaches the ranks
(:func:`rank_variables`, which ``--dry-run`` shows). A setting of the ranks with a ringrun
flag (``--timeout``) is declared in :mod:`ringplug.config` alone and becomes a field
here by itself (:func:`with_flagged_variables`); a launch setting is one field, plus its
tests and docs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringplug import config, wire

_METADATA_KEY = "ringrun"


class SettingsError(ValueError):
    """A setting with a value ``ringrun`` cannot use."""


# ----------------------------------------------------------------------------------- kinds
def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class SettingKind:
    """How a setting is written: in a config file, and as a flag's value.

    Args:
        convert: a config file's value -> the field's; raises :class:`SettingsError`
            (given the ``"source: key"`` to start its message with) when it is wrong.
        flag_type: parses one flag value (argparse's ``type``). Defaults to ``None`` (text).
        repeated: its flags may be given several times, each adding to a list. Defaults
            to ``False``.
        from_flags: the parsed flag value (a list when repeated) -> the field's. Defaults
            to the value itself.
        merge: how a file's value and the flags' combine, when not the flags' replacing
            the file's. Defaults to ``None`` (replace).
    """

    convert: Callable[[Any, str], Any]
    flag_type: Callable[[str], Any] | None = None
    repeated: bool = False
    from_flags: Callable[[Any], Any] = _same
    merge: Callable[[Any, Any], Any] | None = None


def _wrong(where: str, expected: str, value: Any) -> SettingsError:
    return SettingsError(f"{where} must be {expected}, got {value!r}")


def _whole(value: Any, where: str) -> int:
    # bool is an int subclass; `np: true` is a mistake worth catching.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(where, "a whole number", value)
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise _wrong(where, "a number", value)
    return float(value)


def _switch(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong(where, "true or false", value)
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _wrong(where, "a string", value)
    return value


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _hosts(value: Any, where: str) -> str | list[str]:
    if isinstance(value, str):
        return value
    if _strings(value):
        return list(value)
    raise _wrong(where, "a string like 'a:2,b:2' or a list of 'host:slots' strings", value)


def _names(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if _strings(value):
        return list(value)
    raise _wrong(where, "a list of interface names", value)


def _arguments(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as error:
            raise _wrong(where, f"arguments a shell can split ({error})", value) from None
    if _strings(value):
        return list(value)
    raise _wrong(where, "a string of arguments or a list of them", value)


def _split_arguments(values: Sequence[str]) -> list[str]:
    """``['-ppn 2', "-genv A 'b c'"]`` -> the words a shell would make of them, in order."""
    words: list[str] = []
    for value in values:
        try:
            words += shlex.split(value)
        except ValueError as error:
            raise SettingsError(
                f"--mpi-args {value!r}: cannot split it into words: {error}"
            ) from None
    return words


def _variables(value: Any, where: str) -> dict[str, str | None]:
    if not isinstance(value, Mapping):
        raise _wrong(where, "a mapping of variable names to values", value)
    env: dict[str, str | None] = {}
    for name, item in value.items():
        if isinstance(item, (dict, list)):
            raise SettingsError(f"{where}.{name} must be a plain value, got {item!r}")
        # YAML and TOML give numbers and booleans their own types; the ranks see text.
        if isinstance(item, bool):
            item = "1" if item else "0"
        env[str(name)] = None if item is None else str(item)
    return env


def _merge_variables(
    mine: dict[str, str | None], theirs: dict[str, str | None]
) -> dict[str, str | None]:
    return {**mine, **theirs}


def _variable_text(value: Any, where: str) -> str:
    # A config file writes numbers as numbers; the ranks read text, and check it.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _wrong(where, "a number or a string", value)
    if isinstance(value, float):
        return f"{value:g}"
    return value if isinstance(value, str) else str(value)


def _variable_flags(values: Sequence[str]) -> dict[str, str | None]:
    """``["A=1", "B"]`` -> ``{"A": "1", "B": None}`` (``None``: forward ringrun's value)."""
    env: dict[str, str | None] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not name:
            raise SettingsError(f"-x {item!r}: expected VAR or VAR=VALUE")
        env[name] = value if sep else None
    return env


WHOLE = SettingKind(_whole, flag_type=int)
"""A whole number."""
NUMBER = SettingKind(_number, flag_type=float)
"""A number (a float; a config file may write a whole one)."""
SWITCH = SettingKind(_switch)
"""True or false; its flags set one of the two (:attr:`Flag.sets`)."""
TEXT = SettingKind(_text)
"""A string: a path, a name, a choice."""
HOSTS = SettingKind(_hosts)
"""``"a:2,b:2"``, or in a config file a list of ``"host:slots"``."""
NAMES = SettingKind(_names, repeated=True, from_flags=list)
"""A list of names; each flag adds one (or a comma-separated few, :attr:`Flag.split`)."""
ARGUMENTS = SettingKind(_arguments, repeated=True, from_flags=_split_arguments)
"""Command-line words, split like a shell would."""
VARIABLE = SettingKind(_variable_text)
"""The text of one ``RINGPLUG_*`` variable, checked as the ranks read it (``ringplug.config``)."""
VARIABLES = SettingKind(
    _variables, repeated=True, from_flags=_variable_flags, merge=_merge_variables
)
"""Environment variables: ``NAME=VALUE`` sets one, ``NAME`` forwards ringrun's value."""


# ----------------------------------------------------------------------------------- flags
@dataclass(frozen=True)
class Flag:
    """One command-line flag of a setting, in one or more spellings.

    Args:
        spellings: ``("-np", "-n", "--num-proc")``.
        horovodrun: listed in ``--help``'s "horovodrun compatibility" group (the
            spellings horovodrun has). Defaults to ``False``.
        sets: for a switch, the value the flag sets. Defaults to ``None`` (takes a value).
        split: each value is a comma-separated list, added to the setting's list.
            Defaults to ``False``.
        help: when the setting's own help does not fit this spelling. Defaults to ``None``.
        choices: the values the flag accepts (after ``normalize``). Defaults to ``None``.
        normalize: applied to the flag's value before the choices are checked (argparse's
            ``type``). Defaults to ``None``.
        exclusive: flags that name the same exclusive group cannot be given together.
            Defaults to ``None``.
        metavar: the value's name in ``--help``, when not the setting's. Defaults to ``None``.
    """

    spellings: tuple[str, ...]
    horovodrun: bool = False
    sets: Any = None
    split: bool = False
    help: str | None = None
    choices: tuple[str, ...] | None = None
    normalize: Callable[[str], Any] | None = None
    exclusive: str | None = None
    metavar: str | None = None


Check = Callable[[Any], None]
"""Raises :class:`SettingsError` for a value the setting cannot take."""


@dataclass(frozen=True)
class Setting:
    """What a field of ``RunSettings`` declares beyond its name, type and default.

    Args:
        kind: how its values are written.
        help: what it means, with its default.
        flags: its command-line flags, ringrun's and horovodrun's.
        metavar: the value's name in ``--help``.
        check: refuses a value out of range.
        ranks: the variables a value sets for the ranks.
        replaces: settings a command-line value clears from the config file.
    """

    kind: SettingKind
    help: str
    flags: tuple[Flag, ...] = ()
    metavar: str | None = None
    check: Check | None = None
    ranks: Callable[[Any], dict[str, str]] | None = None
    replaces: tuple[str, ...] = ()


def setting(
    kind: SettingKind,
    help: str,
    *,
    flags: Sequence[str] | Sequence[Flag] = (),
    horovodrun: Sequence[str] = (),
    default: Any = None,
    default_factory: Callable[[], Any] | None = None,
    metavar: str | None = None,
    check: Check | None = None,
    ranks: Callable[[Any], dict[str, str]] | None = None,
    replaces: Sequence[str] = (),
) -> Any:
    """A ``RunSettings`` field that declares a whole setting.

    Args:
        kind: how the value is written (:data:`WHOLE`, :data:`NUMBER`, :data:`SWITCH`, ...).
        help: what it means, for ``--help``, with its default.
        flags: ringrun's spellings of one flag (``("-np", "-n")``), or a list of
            :class:`Flag` for several flags or special ones.
            Defaults to none (a config-file key only).
        horovodrun: horovodrun's spellings, listed in their own ``--help`` group.
        default: the value when neither a flag nor the config file gives one; ``None``
            means "not given". Defaults to ``None``.
        default_factory: makes the default instead (for lists and dicts).
        metavar: the value's name in ``--help``.
        check: refuses values out of range, after flags and file are merged.
        ranks: the ``RINGPLUG_*`` variables a given value sets for the ranks.
        replaces: settings that a value given on the command line clears from the config
            file (``-H`` and ``--hostfile`` say the same thing).
    """
    declared: list[Flag] = []
    if flags and all(isinstance(flag, str) for flag in flags):
        declared.append(Flag(tuple(flags)))  # type: ignore[arg-type]
    else:
        declared += flags  # type: ignore[arg-type]
    if horovodrun:
        declared.append(Flag(tuple(horovodrun), horovodrun=True))
    metadata = {
        _METADATA_KEY: Setting(kind, help, tuple(declared), metavar, check, ranks, tuple(replaces))
    }
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _variable_value(variable: config.Variable) -> Callable[[Any], dict[str, str]]:
    def ranks(text: str) -> dict[str, str]:
        if variable.form == config.PATH:
            # Absolute, so a rank writes where the user asked whatever its working directory.
            text = str(Path(text).expanduser().resolve())
        return {variable.name: text}

    return ranks


def variable_help(variable: config.Variable) -> str:
    """ringrun's help for the flag of a ``RINGPLUG_*`` variable: its meaning and default."""
    unset = variable.default is None and variable.default_doc is None
    default = "" if unset else f"; default {variable.default_text}"
    text = f"{variable.doc} ({variable.name}{default})"
    return text.replace("`", "")  # the docs' markdown


def with_flagged_variables(cls: type) -> type:
    """Add to ``cls`` (before ``@dataclass``) a setting for each ``RINGPLUG_*`` variable with
    a ringrun flag (``ringplug.config``): the flag, its help and check come from the variable's
    declaration, the config-file key is :attr:`~ringplug.config.Variable.key`, and a
    value given reaches the ranks as that variable."""
    annotations = cls.__dict__.get("__annotations__", {})
    for variable in config.VARIABLES:
        if variable.flag is None:
            continue
        flags = [Flag((variable.flag,), metavar=variable.metavar)]
        if variable.horovodrun is not None:
            flags.append(
                Flag((variable.horovodrun,), horovodrun=True, help=f"same as {variable.flag}")
            )
        if variable.horovodrun_switch is not None:
            switch, value = variable.horovodrun_switch
            flags.append(
                Flag(
                    (switch,), horovodrun=True, sets=value, help=f"same as {variable.flag} {value}"
                )
            )
        annotations[variable.key] = "str | None"
        setattr(
            cls,
            variable.key,
            setting(
                VARIABLE,
                variable_help(variable),
                flags=flags,
                metavar=variable.metavar,
                ranks=_variable_value(variable),
            ),
        )
    cls.__annotations__ = annotations
    return cls


def declarations(cls: type) -> list[tuple[str, Setting]]:
    """Each setting of ``cls`` (a ``RunSettings``) with its declaration, in field order."""
    return [
        (field.name, field.metadata[_METADATA_KEY])
        for field in dataclasses.fields(cls)
        if _METADATA_KEY in field.metadata
    ]


# ------------------------------------------------------------------------- checks of ranges
def within(
    message: str,
    *,
    low: float | None = None,
    above: float | None = None,
    high: float | None = None,
    below: float | None = None,
) -> Check:
    """A check that the value is ``>= low``, ``> above``, ``<= high`` and ``< below``.

    ``message`` is the error, with ``{value}`` where the value goes. NaN fails every bound.
    """

    def check(value: Any) -> None:
        fits = (
            (low is None or value >= low)
            and (above is None or value > above)
            and (high is None or value <= high)
            and (below is None or value < below)
        )
        if not fits:
            raise SettingsError(message.format(value=value))

    return check


def one_of(name: str, choices: Sequence[str], normalize: Callable[[str], str] = str) -> Check:
    """A check that the value (after ``normalize``) is one of ``choices``."""

    def check(value: Any) -> None:
        if normalize(value) not in choices:
            raise SettingsError(f"{name} must be one of {', '.join(choices)}, got {value!r}")

    return check


# ---------------------------------------------------------------- readers of the declaration
class _SplitAppend(argparse.Action):
    """Append the comma-separated items of the value to a list shared with other flags."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[str] | None,
        option_string: str | None = None,
    ) -> None:
        items = [item.strip() for item in str(values).split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentError(self, "expected interface names such as eth0,ib0")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *items])


def add_flags(
    cls: type, parser: argparse.ArgumentParser | argparse._ArgumentGroup, horovodrun: bool
) -> None:
    """Add the flags of every setting of ``cls`` (ringrun's, or horovodrun's) to ``parser``."""
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for name, declared in declarations(cls):
        for flag in declared.flags:
            if flag.horovodrun != horovodrun:
                continue
            target: Any = parser
            if flag.exclusive is not None:
                if flag.exclusive not in exclusive:
                    exclusive[flag.exclusive] = parser.add_mutually_exclusive_group()
                target = exclusive[flag.exclusive]
            options: dict[str, Any] = {"dest": name, "help": flag.help or declared.help}
            if flag.sets is not None:
                options.update(action="store_const", const=flag.sets)
            else:
                options["metavar"] = flag.metavar or declared.metavar
                if flag.split:
                    options["action"] = _SplitAppend
                elif declared.kind.repeated:
                    options["action"] = "append"
                kind_type = flag.normalize or declared.kind.flag_type
                if kind_type is not None:
                    options["type"] = kind_type
                if flag.choices is not None:
                    options["choices"] = flag.choices
            target.add_argument(*flag.spellings, **options)


def from_flags(cls: type, args: argparse.Namespace) -> Any:
    """The settings the parsed flags give; the others keep their defaults ("not given")."""
    given = {}
    for name, declared in declarations(cls):
        value = getattr(args, name, None)
        if value is not None:
            given[name] = declared.kind.from_flags(value)
    return cls(**given)


def from_mapping(cls: type, values: Mapping[str, Any], source: str) -> Any:
    """The settings a parsed config file gives, its keys and values checked.

    Raises:
        SettingsError: an unknown key or a value of the wrong type; the message names
            ``source``, the key and what was expected.
    """
    known = dict(declarations(cls))
    unknown = [key for key in values if key not in known]
    if unknown:
        raise SettingsError(
            f"{source}: unknown setting {unknown[0]!r}. Allowed settings: {', '.join(known)}."
        )
    return cls(
        **{key: known[key].kind.convert(value, f"{source}: {key}") for key, value in values.items()}
    )


def overridden(base: Any, other: Any) -> Any:
    """``base`` with every setting that ``other`` gives taking precedence.

    A setting is given when it differs from its default; kinds with a merge (``env``)
    combine the two, key by key, ``other`` winning. A given setting clears those it
    replaces from ``base``.
    """
    defaults = type(base)()
    changes: dict[str, Any] = {}
    for name, declared in declarations(type(base)):
        mine, theirs = getattr(base, name), getattr(other, name)
        if declared.kind.merge is not None:
            changes[name] = declared.kind.merge(mine, theirs)
        elif theirs != getattr(defaults, name):
            changes[name] = theirs
            for cleared in declared.replaces:
                changes.setdefault(cleared, getattr(defaults, cleared))
    return dataclasses.replace(base, **changes)


def check_values(settings: Any) -> None:
    """Run each given setting's own check, then check the ``RINGPLUG_*`` values it would give
    the ranks as they read them (the combinations are the class's to check)."""
    for name, declared in declarations(type(settings)):
        value = getattr(settings, name)
        if value is None:
            continue
        if declared.check is not None:
            declared.check(value)
        for variable, text in (declared.ranks(value) if declared.ranks else {}).items():
            try:
                config.check(variable, text)
            except ValueError as error:
                flag = next((flag.spellings[0] for flag in declared.flags), None)
                where = f"{flag} ({name})" if flag else name
                raise SettingsError(f"{where}: {error}") from None


def rank_variables(settings: Any) -> dict[str, str]:
    """The variables the given settings set for the ranks, later settings winning."""
    values: dict[str, str] = {}
    for name, declared in declarations(type(settings)):
        value = getattr(settings, name)
        if declared.ranks is not None and value is not None:
            values.update(declared.ranks(value))
    return values


# ============================================================================ the settings
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

    Besides these, each ``RINGPLUG_*`` variable declared with a flag in ``ringplug.config``
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
    autotune: bool | None = setting(
        SWITCH,
        "tune the fusion threshold, the cycle time and the allreduce algorithm while "
        "training, keeping the best "
        f"({config.AUTOTUNE.name}=1; see --autotune-log-file and the other --autotune-* "
        "flags); not with --fusion-threshold-mb or --cycle-time-ms",
        flags=[Flag(("--autotune",), horovodrun=True, sets=True)],
        ranks=lambda on: {config.AUTOTUNE.name: "1" if on else "0"},
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
        return [name for name, _ in declarations(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> RunSettings:
        """Build settings from a parsed config file, checking keys and value types.

        Raises:
            SettingsError: for an unknown key or a value of the wrong type; the message
                names ``source``, the key and what was expected.
        """
        return from_mapping(cls, values, source)

    def overridden_by(self, other: RunSettings) -> RunSettings:
        """These settings with every field that ``other`` sets taking precedence.

        ``env`` is merged key by key (``other`` wins on clashes); other fields are replaced
        whole when ``other`` gives them, and ``-H`` / ``--hostfile`` replace each other.
        """
        return overridden(self, other)

    def validate(self) -> None:
        """Check each setting, then their combinations, after config file and flags merge."""
        if self.hosts and self.hostfile:
            raise SettingsError("give hosts (-H) or a hostfile (--hostfile), not both")
        check_values(self)
        self._check_autotune()
        timed = (
            self.stall_check_warning_time_seconds is not None
            or self.stall_check_shutdown_time_seconds is not None
        )
        if self.stall_check is False and timed:
            raise SettingsError(
                "the stall check is turned off (--no-stall-check), so its warning and shutdown "
                "times would do nothing; give one or the other"
            )

    def _check_autotune(self) -> None:
        """Refuse autotune (``--autotune`` or ``-x RINGPLUG_AUTOTUNE=1``) together with a
        setting it tunes, before anything is launched."""
        given = dict(rank_variables(self))
        given.update({k: v for k, v in self.env.items() if v is not None})
        on = given.get(config.AUTOTUNE.name)
        try:
            autotune = bool(on is not None and config.AUTOTUNE.parse(on))
        except ValueError as error:
            raise SettingsError(str(error)) from None
        fixed = {v.name: given[v.name] for v in config.AUTOTUNED if v.name in given}
        conflict = config.autotune_conflict(autotune, fixed)
        if conflict is not None:
            raise SettingsError(conflict)

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

        The names and units are those :mod:`ringplug.config` reads.
        """
        return rank_variables(self)
