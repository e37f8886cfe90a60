"""Every ``RINGPLUG_*`` setting, declared once: name, type, bounds, default, meaning, flag.

Each :class:`Variable` below is one setting. From the declarations come the ranks' config
(:class:`Settings`, read by :func:`read_settings` at ``ringplug.init()``), ringrun's flags
for them (``ringplug.run.settings`` adds a flag for each variable that names one, its help
and default from here), the validation on both sides (:meth:`Variable.parse`, which ringrun
runs on every value it would give the ranks) and the table of docs/configuration.md
(``python tools/settings_table.py`` writes it; tests/test_config.py checks that the page
and the declarations agree). A new setting is one :class:`Variable` here (and a
:class:`Settings` field, when the engine reads it), plus its tests.

The variables ringrun and the ranks exchange that are no settings (the event token, the
restart count) are in :mod:`ringplug.wire`. Standard library only: ringrun and the core
both import this (``ringplug`` itself loads nothing), and ringrun's side loads no numpy.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import wire

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """Parse a byte count such as "65536", "64K", "16M", "1G" or "16MiB"."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _UNITS else ""
    number = value[: len(value) - len(unit)] if unit else value
    try:
        result = int(float(number) * _UNITS[unit])
    except (ValueError, OverflowError):  # not a number, nan or inf
        raise ValueError(
            f"Cannot read {text!r} as a byte count; write e.g. 65536, 64K or 16M."
        ) from None
    if result < 0:
        raise ValueError(f"Byte count {text!r} must not be negative.")
    return result


def bytes_text(count: int) -> str:
    """A byte count as `parse_bytes` reads it, in the largest unit that divides it: "64K"."""
    for unit in ("G", "M", "K"):
        if count and count % _UNITS[unit] == 0:
            return f"{count // _UNITS[unit]}{unit}"
    return str(count)


# Python logging's names (what the handler accepts).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")

_SWITCH_WORDS = {
    "1": True,
    "true": True,
    "on": True,
    "yes": True,
    "0": False,
    "false": False,
    "off": False,
    "no": False,
}

# What a variable's text is (Variable.form).
SECONDS = "seconds"
MILLISECONDS = "milliseconds"
BYTES = "bytes"
COUNT = "count"
LEVEL = "level"
SWITCH = "switch"
PATH = "path"
PROGRAM = "program"
CHOICE = "choice"
TEXT = "text"

RANKS = "the ranks"
RINGRUN = "ringrun"


@dataclass(frozen=True)
class Variable:
    """One ``RINGPLUG_*`` setting, declared whole.

    Args:
        name: the environment variable, ``RINGPLUG_TIMEOUT``.
        form: what its text is: :data:`SECONDS`, :data:`MILLISECONDS`, :data:`BYTES`,
            :data:`COUNT`, :data:`LEVEL`, :data:`SWITCH`, :data:`PATH`, :data:`PROGRAM`,
            :data:`CHOICE` or :data:`TEXT` (checked by its reader).
        default: its value when unset, in its own unit (``None``: unset means "not given").
        doc: what it means, one sentence for the docs' table and ringrun's help.
        field: the :class:`Settings` field the ranks' engine reads it into, if any.
        least: the smallest value it takes (``None``: positive for times, 0 otherwise).
        most: the largest value it takes. Defaults to no bound.
        zero: what 0 means, when 0 is allowed for a time (``"never"``). Defaults to ``None``
            (0 is refused).
        infinite: what ``inf`` means, when a time takes it. Defaults to ``None`` (refused).
        flag: ringrun's flag that sets it (``--timeout``). Defaults to none.
        horovodrun: horovodrun's spelling of that flag, if it has one.
        horovodrun_switch: a horovodrun switch that sets it to a fixed value, and the
            value: ``("--hierarchical-allreduce", "allreduce=hierarchical")``.
        readers: who reads it: :data:`RANKS`, :data:`RINGRUN` or both.
        default_doc: the default as the docs say it, when not the value itself.
        metavar: the flag value's name in ringrun's help.
        scale: the factor from its unit to the :class:`Settings` field's (ms -> s: 1e-3).
        choices: the words a :data:`CHOICE` takes (the first is the default's spelling).
    """

    name: str
    form: str
    default: Any
    doc: str
    field: str | None = None
    least: float | None = None
    most: float | None = None
    zero: str | None = None
    infinite: str | None = None
    flag: str | None = None
    horovodrun: str | None = None
    horovodrun_switch: tuple[str, str] | None = None
    readers: tuple[str, ...] = (RANKS,)
    default_doc: str | None = None
    metavar: str | None = None
    scale: float = 1.0
    choices: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The config-file key of its ringrun flag: ``timeout`` for ``RINGPLUG_TIMEOUT``."""
        return self.name.removeprefix("RINGPLUG_").lower()

    def given(self, environ: Mapping[str, str] | None = None) -> str | None:
        """Its text in ``environ`` (default ``os.environ``), ``None`` when unset or empty."""
        value = (os.environ if environ is None else environ).get(self.name)
        return value if value not in (None, "") else None

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """Its value in ``environ`` (default ``os.environ``), else its default.

        Raises:
            ValueError: the text is not a value it takes; the message names the variable
                and says what to write.
        """
        text = self.given(environ)
        return self.default if text is None else self.parse(text)

    def parse(self, text: str) -> Any:
        """The value of ``text``, checked against the bounds (see :meth:`read`)."""
        if self.form in (SECONDS, MILLISECONDS):
            return self._time(text)
        if self.form == BYTES:
            return self._bytes(text)
        if self.form == COUNT:
            return self._count(text)
        if self.form == LEVEL:
            level = text.strip().upper()
            if level not in LOG_LEVELS:
                raise ValueError(
                    f"{self.name}={level!r} is not a log level; use one of {', '.join(LOG_LEVELS)}."
                )
            return level
        if self.form == CHOICE:
            word = text.strip().lower()
            if word not in self.choices:
                raise ValueError(f"{self.name}={text!r}: use one of {', '.join(self.choices)}.")
            return word
        if self.form == SWITCH:
            if text.lower() not in _SWITCH_WORDS:
                raise ValueError(f"{self.name}={text!r}: use 1 (on) or 0 (off).")
            return _SWITCH_WORDS[text.lower()]
        return text  # a path, a program or a text its reader checks

    def _time(self, raw: str) -> float:
        unit = self.form
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r} is not a number of {unit}.") from None
        if math.isnan(value) or (math.isinf(value) and self.infinite is None):
            never = f" (or inf: {self.infinite})" if self.infinite else ""
            raise ValueError(f"{self.name}={raw!r} must be a finite number of {unit}{never}.")
        if value < 0 or (value == 0 and self.zero is None):
            kind = f"a non-negative (0: {self.zero})" if self.zero else "a positive"
            raise ValueError(f"{self.name}={raw!r} must be {kind} number of {unit}.")
        if self.most is not None and value > self.most:
            raise ValueError(f"{self.name}={raw!r} must be at most {self.most:g} {unit}.")
        return value

    def _bytes(self, raw: str) -> int:
        try:
            count = parse_bytes(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        if self.least is not None and count < self.least:
            raise ValueError(
                f"{self.name} must be at least {self.least:g} bytes, got {count} ({raw!r})."
            )
        return count

    def _count(self, raw: str) -> int:
        least = int(self.least or 0)
        text = raw.strip()
        if not text.isdigit() or int(text) < least or (self.most and int(text) > self.most):
            upto = f"from {least} to {int(self.most)}" if self.most else f"of at least {least}"
            raise ValueError(f"{self.name}={raw!r} must be a whole number {upto}.")
        return int(text)

    def field_value(self, value: Any) -> Any:
        """``value`` in the unit of its :class:`Settings` field."""
        if value is None or self.scale == 1.0:
            return value
        return value * self.scale

    @property
    def default_text(self) -> str:
        """The default as ringrun's help and the docs write it."""
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None:
            return "unset"
        if self.form == BYTES:
            return bytes_text(self.default)
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)


# ------------------------------------------------------------------------- the declarations
TIMEOUT = Variable(
    "RINGPLUG_TIMEOUT",
    SECONDS,
    600.0,
    "seconds any wait for peers (negotiation, ring, MPI's collectives, a missing collective) "
    "may last before the job ends, naming the ranks that stopped taking part; finite",
    field="timeout",
    flag="--timeout",
    metavar="SECONDS",
)
"""Ten minutes, as torch's NCCL watchdog: long enough for a slow checkpoint on one rank,
never half an hour of silence."""

BARRIER_TIMEOUT = Variable(
    "RINGPLUG_BARRIER_TIMEOUT",
    SECONDS,
    7200.0,
    "the longest a barrier with a timeout of its own waits (torch's `monitored_barrier`; "
    "Lightning's around `prepare_data` and Fabric's `rank_zero_first` ask for 10,000 days), "
    "then `BarrierTimeoutError` names the ranks that never arrived",
    field="barrier_timeout",
)
"""Two hours: a download of a large data set, never a job silent for days; shorter
timeouts are kept."""

EAGER_THRESHOLD = Variable(
    "RINGPLUG_EAGER_THRESHOLD",
    BYTES,
    64 << 10,
    "most bytes of small allreduces carried inside one negotiation message, on up to 7 ranks "
    "(0: none)",
    field="eager_threshold",
)
"""Allreduces of forms agreed before travel inside the negotiation message, and each rank
reduces them itself. Only on up to 7 ranks: carried data reaches every rank, (p - 1) n
bytes per rank where recursive doubling sends n ceil(log2 p) (`engine.exchange.gathers_only`).
Measured on the 2-core CI machine, 2 ranks: up to 64 KiB it saves MPI's
Allreduce after the negotiation (a 4 KiB synchronous allreduce, medians of 3 runs: 46
against 52 us); from 256 KiB the copies cost more than that Allreduce (1M: 609 against
269 us)."""

FUSION_THRESHOLD = Variable(
    "RINGPLUG_FUSION_THRESHOLD",
    BYTES,
    64 << 20,
    "most bytes of allreduces fused into one collective",
    field="fusion_threshold",
)
"""Allreduces of one dtype and op that are ready together are packed into one buffer of at
most this many bytes and reduced in one pass."""

CYCLE_TIME = Variable(
    "RINGPLUG_CYCLE_TIME",
    MILLISECONDS,
    0.0,
    "milliseconds the engine waits after a submission for more to fuse with",
    field="cycle_time",
    zero="run each cycle with what has arrived",
    most=1000,
    scale=1e-3,
)
"""The engine's `cycle_time` is in seconds. A cycle time is a pause before every cycle:
more than a second is a mistake."""

AUTOTUNE = Variable(
    "RINGPLUG_AUTOTUNE",
    SWITCH,
    False,
    "`1` (ringrun's `--autotune`) tunes `RINGPLUG_FUSION_THRESHOLD`, `RINGPLUG_CYCLE_TIME` "
    "and the host allreduce's algorithm crossovers around the step's buffers (unless "
    "`RINGPLUG_ALGORITHM` forces the allreduce) while "
    "training (every rank applies rank 0's choice at the same cycle) and keeps the best; "
    "not together with a fixed fusion threshold or cycle time",
    field="autotune",
    default_doc="`0` (off)",
)
"""The search and its budget: `ringplug.core.autotune`; usage: docs/configuration.md."""

AUTOTUNE_LOG = Variable(
    "RINGPLUG_AUTOTUNE_LOG",
    PATH,
    None,
    "the CSV file where rank 0 writes every autotune trial (sample, fusion_threshold, "
    "cycle_time_ms, allreduce_algorithm, allreduce_crossovers, score, best_score, converged, "
    "steps)",
    field="autotune_log",
    flag="--autotune-log-file",
    metavar="PATH",
)

AUTOTUNE_WARMUP_SAMPLES = Variable(
    "RINGPLUG_AUTOTUNE_WARMUP_SAMPLES",
    COUNT,
    1,
    "autotune: samples at the start setting that are not scored (the first steps compile, "
    "allocate and fill caches)",
    field="autotune_warmup_samples",
    flag="--autotune-warmup-samples",
    metavar="N",
    most=100,
)

AUTOTUNE_STEPS_PER_SAMPLE = Variable(
    "RINGPLUG_AUTOTUNE_STEPS_PER_SAMPLE",
    COUNT,
    3,
    "autotune: training steps (a step ends where a gradient's name comes again) scored "
    "per trial setting; the first of them, after the change, is not timed",
    field="autotune_steps_per_sample",
    flag="--autotune-steps-per-sample",
    metavar="N",
    least=2,
    most=10_000,
)

AUTOTUNE_MAX_SAMPLES = Variable(
    "RINGPLUG_AUTOTUNE_MAX_SAMPLES",
    COUNT,
    15,
    "autotune: the most trial settings scored before it keeps the best (it stops sooner "
    "when no neighbour of the best is better)",
    field="autotune_max_samples",
    flag="--autotune-max-samples",
    horovodrun="--autotune-bayes-opt-max-samples",
    metavar="N",
    least=1,
    most=1000,
)
"""With the defaults, (1 + 15) x 3 = 48 steps at most are spent tuning."""

RING_THRESHOLD = Variable(
    "RINGPLUG_RING_THRESHOLD",
    BYTES,
    None,
    "from this size on, allreduce and reducescatter use ringplug's ring instead of MPI's own "
    "collectives, and allgather and broadcast are MPI's at every size: the fixed algorithm "
    "table, no calibration",
    field="ring_threshold",
    default_doc="unset: measured (`1M` with `RINGPLUG_CALIBRATION=fixed`)",
)
"""Unset, the algorithm table's crossovers are measured (`RINGPLUG_CALIBRATION`). Its value
with `RINGPLUG_CALIBRATION=fixed`, 1 MiB, was measured on the 2-core CI machine, 2 ranks,
both paths and MPI's Allreduce interleaved in one run (5 runs, medians of the speed against
MPI's Allreduce): at 1 MiB the ring reached 0.88-0.97x, MPI's Iallreduce 0.72-0.87x; at 2
MiB 0.96-1.12x against 0.73-0.99x; at 512 KiB the ring lost (0.75-0.78x against
0.78-0.85x)."""

FIXED_RING_THRESHOLD = 1 << 20
"""The ring's threshold of the fixed table when `RINGPLUG_RING_THRESHOLD` is unset."""

CALIBRATION = Variable(
    "RINGPLUG_CALIBRATION",
    CHOICE,
    "auto",
    "how the ranks learn which algorithm each collective takes by size: `auto` loads the "
    "table cached for this job's hosts, rank count, MPI library and ringplug version, else "
    "measures it at the first collective and caches it; `fresh` measures again; `fixed` uses "
    "the fixed table (`RINGPLUG_RING_THRESHOLD`)",
    field="calibration",
    flag="--calibration",
    metavar="auto|fresh|fixed",
    choices=("auto", "fresh", "fixed"),
)
"""The measurement times each candidate at a few sizes on the job's own ranks and fits an
alpha-beta model to each (`ringplug.core.transport.calibration`); `ringplug-bench
algorithms` prints it."""

CALIBRATION_SECONDS = Variable(
    "RINGPLUG_CALIBRATION_SECONDS",
    SECONDS,
    3.0,
    "the longest the algorithm table's measurement may take; past it the sizes measured so "
    "far are fitted (fewer than two: the fixed table)",
    field="calibration_seconds",
    most=600,
)

ALGORITHM = Variable(
    "RINGPLUG_ALGORITHM",
    TEXT,
    None,
    "force algorithms whatever the size: `ring`, `mpi`, ... for every kind that has it, or "
    "pairs such as `allreduce=ring,allgather=mpi` (kinds: allreduce, reducescatter, "
    "allgather, broadcast; algorithms: mpi, doubling, ring, chain, and hierarchical for "
    "allreduce on several hosts)",
    field="algorithm",
    flag="--algorithm",
    horovodrun_switch=("--hierarchical-allreduce", "allreduce=hierarchical"),
    metavar="NAME|KIND=NAME,...",
)
"""A forced algorithm is still refused where it cannot reduce: Max of float16 never takes
MPI's Allreduce. The rest of the table is measured as usual. A forced `hierarchical` on ranks
that are all on one host (or each on a host of its own) is an error at the first collective,
on every rank."""

TEST_RANKS_PER_HOST = Variable(
    "RINGPLUG_TEST_RANKS_PER_HOST",
    COUNT,
    None,
    "tests only: world ranks `i*k` to `i*k+k-1` count as one pretend host `i` for the "
    "hierarchical allreduce, so that one machine runs it on several hosts (its timings mean "
    "nothing then)",
    least=1,
)

RING_SEGMENT = Variable(
    "RINGPLUG_RING_SEGMENT",
    BYTES,
    512 << 10,
    "bytes per ring pipeline segment (fits the L2 cache)",
    field="ring_segment",
    least=64,
)
"""Small enough that received data is still in the L2 cache when it is reduced (256 KiB to
2 MiB measured alike at 64 MiB; 512 KiB best)."""

STALL_CHECK_SECONDS = Variable(
    "RINGPLUG_STALL_CHECK_SECONDS",
    SECONDS,
    60.0,
    "rank 0 warns about collectives some ranks submitted and others did not, and a rank "
    "waiting that long names the ranks that stopped taking part (`inf`: never)",
    field="stall_check_seconds",
    infinite="never",
)

STALL_SHUTDOWN_SECONDS = Variable(
    "RINGPLUG_STALL_SHUTDOWN_SECONDS",
    SECONDS,
    0.0,
    "after this long every rank raises `StallError` instead of waiting (and a wait for a "
    "frozen peer ends the job, if sooner than `RINGPLUG_TIMEOUT`)",
    field="stall_shutdown_seconds",
    zero="never",
    default_doc="`0` (off)",
)

TIMELINE = Variable(
    "RINGPLUG_TIMELINE",
    PATH,
    None,
    "path of a Chrome trace of the engine (negotiation, fusion, collectives), written by "
    "rank 0; open it in Perfetto or chrome://tracing",
    field="timeline",
    flag="--timeline",
    horovodrun="--timeline-filename",
    metavar="PATH",
)

FLIGHT_RECORD = Variable(
    "RINGPLUG_FLIGHT_RECORD",
    COUNT,
    128,
    "how many of its last collectives each rank keeps for stall reports and "
    "`ringrun --explain` (0: none)",
    field="flight_record",
    most=1 << 20,
)

FLIGHT_DIR = Variable(
    "RINGPLUG_FLIGHT_DIR",
    PATH,
    None,
    "where flight records are written (ringrun's one file per job, or each rank's own "
    "without ringrun)",
    readers=(RANKS, RINGRUN),
    default_doc="the temporary folder",
)

DIAGNOSE = Variable(
    "RINGPLUG_DIAGNOSE",
    SWITCH,
    None,
    "`0` turns the step-time breakdown and its verdict off (`1` on; Keras: `RingDiagnose`)",
    default_doc="`1` under `RingStrategy`",
)

DIAGNOSE_EVERY = Variable(
    "RINGPLUG_DIAGNOSE_EVERY",
    COUNT,
    None,
    "also report the breakdown every N training steps",
    least=1,
)

LOG_LEVEL = Variable(
    "RINGPLUG_LOG_LEVEL",
    LEVEL,
    "WARNING",
    "log level; ranks other than 0 log errors only unless this is set",
    field="log_level",
    readers=(RANKS, RINGRUN),
)

NCCL_LIB = Variable(
    "RINGPLUG_NCCL_LIB",
    PATH,
    None,
    "the NCCL library (or its folder) to use, instead of searching",
)

CUDART_LIB = Variable(
    "RINGPLUG_CUDART_LIB",
    PATH,
    None,
    "the CUDA runtime library for TensorFlow/JAX GPU tensors",
)

ELASTIC_DIR = Variable(
    "RINGPLUG_ELASTIC_DIR",
    PATH,
    None,
    "where Horovod-style elastic commits are written ([When a node dies](elastic.md))",
    default_doc="the host's temporary folder",
)

SPLIT_THREADS = Variable(
    "RINGPLUG_SPLIT_THREADS",
    SWITCH,
    True,
    "ringrun sets `OMP_NUM_THREADS` for each rank that has none to its share of its host's "
    "cores (cores // ranks on that host), as torchrun sets 1; `0` leaves it unset",
    readers=(RINGRUN,),
    default_doc="`1`",
)
"""Unset, each rank sized its thread pools by itself: torch's MKL builds saw MPICH's or Open
MPI's local-size variable and ran one thread whatever the cores, other builds took every
core in every rank (2 and 4 ranks on 2 cores with 2 threads each: 3 to 4 times the time per
step of one thread each). Measurements in docs/torch.md."""

MPIEXEC = Variable(
    "RINGPLUG_MPIEXEC",
    PROGRAM,
    None,
    "the MPI launcher ringrun runs (a path or a command name), before the virtualenv's "
    "`mpiexec` and `PATH` ([Which launcher ringrun uses](ringrun.md#which-launcher-ringrun-uses))",
    readers=(RINGRUN,),
)

VARIABLES: tuple[Variable, ...] = tuple(
    value for value in list(globals().values()) if isinstance(value, Variable)
)
"""Every setting, in the order declared."""

BY_NAME: dict[str, Variable] = {variable.name: variable for variable in VARIABLES}


def check(name: str, text: str) -> None:
    """Refuse ``text`` as the value of variable ``name`` as the ranks would (nothing for a
    name that is no declared setting).

    Raises:
        ValueError: what :meth:`Variable.parse` says.
    """
    if name in BY_NAME:
        BY_NAME[name].parse(text)


# --------------------------------------------------------------------------- the ranks' config
@dataclass(frozen=True)
class Settings:
    """The ranks' knobs, read from the ``RINGPLUG_*`` variables declared above (their meaning,
    bounds and defaults are there); constructor arguments elsewhere win over these."""

    timeout: float = TIMEOUT.default
    ring_threshold: int | None = RING_THRESHOLD.default
    calibration: str = CALIBRATION.default
    calibration_seconds: float = CALIBRATION_SECONDS.default
    algorithm: str | None = ALGORITHM.default
    ring_segment: int = RING_SEGMENT.default
    eager_threshold: int = EAGER_THRESHOLD.default
    fusion_threshold: int = FUSION_THRESHOLD.default
    cycle_time: float = CYCLE_TIME.field_value(CYCLE_TIME.default)  # seconds
    barrier_timeout: float = BARRIER_TIMEOUT.default
    stall_check_seconds: float = STALL_CHECK_SECONDS.default
    stall_shutdown_seconds: float = STALL_SHUTDOWN_SECONDS.default
    timeline: str | None = TIMELINE.default
    autotune: bool = AUTOTUNE.default
    autotune_log: str | None = AUTOTUNE_LOG.default
    autotune_warmup_samples: int = AUTOTUNE_WARMUP_SAMPLES.default
    autotune_steps_per_sample: int = AUTOTUNE_STEPS_PER_SAMPLE.default
    autotune_max_samples: int = AUTOTUNE_MAX_SAMPLES.default
    flight_record: int = FLIGHT_RECORD.default
    log_level: str = LOG_LEVEL.default


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the environment (default ``os.environ``) into a `Settings` (at ``ringplug.init()``).

    Raises:
        ValueError: a value it cannot take, or ``RINGPLUG_AUTOTUNE=1`` with a setting it
            tunes given too (:func:`check_autotune`).
    """
    check_autotune(environ)
    return Settings(
        **{
            variable.field: variable.field_value(variable.read(environ))
            for variable in VARIABLES
            if variable.field is not None
        }
    )


AUTOTUNED: tuple[Variable, ...] = (FUSION_THRESHOLD, CYCLE_TIME)
"""The settings ``RINGPLUG_AUTOTUNE`` chooses (none of them may be given with it)."""


def autotune_conflict(autotune: bool, given: Mapping[str, str]) -> str | None:
    """The error of autotune turned on with settings it tunes fixed too (``given``: their
    names and values, as given), or ``None``. Worded for ringrun's flags and the variables."""
    fixed = [f"{name}={value}" for name, value in given.items()]
    if not (autotune and fixed):
        return None
    return (
        f"{AUTOTUNE.name}=1 (ringrun --autotune) tunes {' and '.join(v.name for v in AUTOTUNED)} "
        f"itself, but {', '.join(fixed)} is fixed too. Drop the fixed value "
        "(--fusion-threshold-mb / --cycle-time-ms, or the variable) to let autotune choose, "
        "or turn autotune off to keep it."
    )


def check_autotune(environ: Mapping[str, str] | None = None) -> None:
    """Refuse ``RINGPLUG_AUTOTUNE=1`` together with a setting it tunes.

    Raises:
        ValueError: what :func:`autotune_conflict` says.
    """
    given = {v.name: text for v in AUTOTUNED if (text := v.given(environ)) is not None}
    conflict = autotune_conflict(bool(AUTOTUNE.read(environ)), given)
    if conflict is not None:
        raise ValueError(conflict)


def diagnose_setting() -> tuple[bool | None, int | None]:
    """``RINGPLUG_DIAGNOSE`` (1/0 turns the step-time breakdown on/off; unset: ``None``,
    the adapter's default) and ``RINGPLUG_DIAGNOSE_EVERY`` (a verdict every N steps too)."""
    return DIAGNOSE.read(), DIAGNOSE_EVERY.read()


def elastic_setting() -> tuple[int, str | None, str | None]:
    """What a rank of an elastic job needs to resume: ``RINGPLUG_RESTART`` (which start of
    the job this is, 0 for the first), ``RINGPLUG_JOB_ID`` (the same in every start of one
    ``ringrun`` job; None outside one) and ``RINGPLUG_ELASTIC_DIR`` (where commits are kept,
    e.g. a shared filesystem; None for the default under the temporary directory)."""
    raw = os.environ.get(wire.RESTART_VARIABLE) or None
    if raw is not None and not raw.isdigit():
        raise ValueError(
            f"{wire.RESTART_VARIABLE}={raw!r} must be a whole number (ringrun sets it)."
        )
    return (
        (int(raw) if raw is not None else 0),
        os.environ.get(wire.JOB_ID_VARIABLE) or None,
        ELASTIC_DIR.read(),
    )


# ------------------------------------------------------------------------- the docs' tables
GENERATED_BEGIN = "<!-- generated by tools/settings_table.py from src/ringplug/config.py -->"
GENERATED_END = "<!-- end of generated tables -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default_cell(variable: Variable) -> str:
    if variable.default is None and variable.default_doc is None:
        return "unset"
    if variable.default_doc is not None:
        return variable.default_doc
    return f"`{variable.default_text}`"


def markdown() -> str:
    """docs/configuration.md's tables of the settings and of what ringrun sets."""
    lines = [
        GENERATED_BEGIN,
        "",
        "| variable | default | ringrun flag | meaning |",
        "|---|---|---|---|",
    ]
    for variable in VARIABLES:
        if RANKS not in variable.readers:
            continue
        flag = f"`{variable.flag}`" if variable.flag else ""
        lines.append(
            f"| `{variable.name}` | {_cell(_default_cell(variable))} | {flag} | "
            f"{_cell(variable.doc)} |"
        )
    lines += [
        "",
        "Rank 0's values are used on every rank.",
        "",
        "## What ringrun reads and sets",
        "",
        "| variable | who | meaning |",
        "|---|---|---|",
    ]
    for variable in VARIABLES:
        if variable.readers == (RINGRUN,):
            lines.append(f"| `{variable.name}` | you, for ringrun | {_cell(variable.doc)} |")
    for name, doc in wire.SET_BY_RINGRUN:
        lines.append(f"| `{name}` | ringrun, for the ranks | {_cell(doc)} |")
    lines += ["", GENERATED_END]
    return "\n".join(lines) + "\n"


def generated_part(page: str) -> str:
    """The generated tables of a docs page's text ("" when it has none)."""
    start, end = page.find(GENERATED_BEGIN), page.find(GENERATED_END)
    if start < 0 or end < start:
        return ""
    return page[start : end + len(GENERATED_END)] + "\n"


def rewrite(page: str) -> str:
    """``page`` with its generated tables replaced by the declarations' own."""
    old = generated_part(page)
    if not old:
        raise ValueError(f"the page has no {GENERATED_BEGIN!r} ... {GENERATED_END!r} part")
    return page.replace(old, markdown())
