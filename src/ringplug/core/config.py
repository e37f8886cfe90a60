"""The one place that reads ringplug's environment variables."""

from __future__ import annotations

import dataclasses
import math
import os

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


@dataclasses.dataclass(frozen=True)
class Settings:
    """Knobs read from `RINGPLUG_*` variables; constructor arguments elsewhere win over these."""

    # Seconds any wait for peers (negotiation, the ring, MPI's collectives) may last before
    # the job ends, naming the ranks that stopped taking part. Ten minutes, as torch's NCCL
    # watchdog: long enough for a slow checkpoint on one rank, never half an hour of silence.
    timeout: float = 600.0
    # From this many bytes on, allreduce uses ringplug's ring instead of MPI's own Allreduce.
    # Measured on the 2-core CI machine, 2 ranks, both paths and MPI's Allreduce interleaved
    # in one run (5 runs, medians of the speed against MPI's Allreduce): at 1 MiB the ring
    # reached 0.88-0.97x, MPI's Iallreduce 0.72-0.87x; at 2 MiB 0.96-1.12x against
    # 0.73-0.99x; at 512 KiB the ring lost (0.75-0.78x against 0.78-0.85x). On 3 and 4 ranks
    # (more ranks than cores) the ring was the faster of the two from 256 KiB to 4 MiB. From
    # 32 MiB MPICH falls to half the ring's bandwidth (it page-faults a fresh temporary every
    # call).
    ring_threshold: int = 1 << 20
    # Bytes per ring pipeline segment: small enough that received data is still in the L2
    # cache when it is reduced (256 KiB to 2 MiB measured alike at 64 MiB; 512 KiB best).
    ring_segment: int = 512 << 10
    # Allreduces of forms agreed before, up to this many bytes in all per cycle, travel
    # inside the negotiation message, and each rank reduces them itself (0: never). Measured
    # on the 2-core CI machine, 2 ranks: up to 64 KiB it saves MPI's Allreduce after the
    # negotiation (a 4 KiB synchronous allreduce, medians of 3 runs: 46 against 52 us);
    # from 256 KiB the copies cost more than that Allreduce (1M: 609 against 269 us).
    eager_threshold: int = 64 << 10
    # Allreduces of one dtype and op that are ready together are packed into one buffer of
    # at most this many bytes and reduced in one pass.
    fusion_threshold: int = 64 << 20
    # Seconds the engine waits after a submission for more requests to fuse with (0: run
    # each cycle with what has arrived; requests that arrive meanwhile form the next one).
    cycle_time: float = 0.0
    # After this long, rank 0 warns about collectives some ranks submitted and others did not,
    # and a rank waiting for peers names those that stopped taking part; after the shutdown
    # period (if > 0) the former raise StallError on every rank and the latter end the job.
    # The longest a barrier that asks for a timeout of its own waits (torch's
    # monitored_barrier: Lightning's around prepare_data, and Fabric's rank_zero_first, ask
    # for 10,000 days while one rank downloads or prepares the data); shorter timeouts are
    # kept. Two hours: a download of a large data set, never a job silent for days.
    barrier_timeout: float = 7200.0
    stall_check_seconds: float = 60.0
    stall_shutdown_seconds: float = 0.0
    # Chrome trace of the engine (written by rank 0), or None.
    timeline: str | None = None
    # How many of its last collectives each rank keeps for stall reports (0: none).
    flight_record: int = 128
    log_level: str = "WARNING"


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _float(
    name: str,
    default: float,
    allow_zero: bool = False,
    unit: str = "seconds",
    allow_inf: bool = False,
    most: float = math.inf,
) -> float:
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of {unit}.") from None
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        never = " (or inf for never)" if allow_inf else ""
        raise ValueError(f"{name}={raw!r} must be a finite number of {unit}{never}.")
    if value < 0 or (value == 0 and not allow_zero):
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name}={raw!r} must be {kind} number of {unit}.")
    if value > most:
        raise ValueError(f"{name}={raw!r} must be at most {most:g} {unit}.")
    return value


def _bytes(name: str, default: int) -> int:
    raw = _env(name)
    if raw is None:
        return default
    try:
        return parse_bytes(raw)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def read_settings() -> Settings:
    """Read the current environment into a `Settings` (called at `ringplug.init()`)."""
    defaults = Settings()
    segment = _bytes("RINGPLUG_RING_SEGMENT", defaults.ring_segment)
    if segment < 64:
        raise ValueError(f"RINGPLUG_RING_SEGMENT must be at least 64 bytes, got {segment}.")
    return Settings(
        timeout=_float("RINGPLUG_TIMEOUT", defaults.timeout),  # every wait has a deadline
        barrier_timeout=_float("RINGPLUG_BARRIER_TIMEOUT", defaults.barrier_timeout),
        ring_threshold=_bytes("RINGPLUG_RING_THRESHOLD", defaults.ring_threshold),
        ring_segment=segment,
        eager_threshold=_bytes("RINGPLUG_EAGER_THRESHOLD", defaults.eager_threshold),
        fusion_threshold=_bytes("RINGPLUG_FUSION_THRESHOLD", defaults.fusion_threshold),
        # A cycle time is a pause before every cycle: more than a second is a mistake.
        cycle_time=_float("RINGPLUG_CYCLE_TIME", 0.0, True, "milliseconds", most=1000) / 1e3,
        stall_check_seconds=_float(
            "RINGPLUG_STALL_CHECK_SECONDS", defaults.stall_check_seconds, allow_inf=True
        ),
        stall_shutdown_seconds=_float(
            "RINGPLUG_STALL_SHUTDOWN_SECONDS", defaults.stall_shutdown_seconds, True
        ),
        timeline=_env("RINGPLUG_TIMELINE"),
        flight_record=_count("RINGPLUG_FLIGHT_RECORD", defaults.flight_record, most=1 << 20),
        log_level=_log_level(),
    )


def _count(name: str, default: int, most: int) -> int:
    raw = _env(name)
    if raw is None:
        return default
    if not raw.strip().isdigit() or int(raw) > most:
        raise ValueError(f"{name}={raw!r} must be a whole number from 0 to {most}.")
    return int(raw)


# Python logging's names (what the handler accepts).
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")


def _log_level() -> str:
    level = (_env("RINGPLUG_LOG_LEVEL") or Settings.log_level).upper()
    if level not in _LOG_LEVELS:
        raise ValueError(
            f"RINGPLUG_LOG_LEVEL={level!r} is not a log level; use one of {', '.join(_LOG_LEVELS)}."
        )
    return level


def diagnose_setting() -> tuple[bool | None, int | None]:
    """``RINGPLUG_DIAGNOSE`` (1/0 turns the step-time breakdown on/off; unset: ``None``,
    the adapter's default) and ``RINGPLUG_DIAGNOSE_EVERY`` (a verdict every N steps too)."""
    raw = _env("RINGPLUG_DIAGNOSE")
    words = {
        "1": True,
        "true": True,
        "on": True,
        "yes": True,
        "0": False,
        "false": False,
        "off": False,
        "no": False,
    }
    if raw is not None and raw.lower() not in words:
        raise ValueError(f"RINGPLUG_DIAGNOSE={raw!r}: use 1 (on) or 0 (off).")
    every = _env("RINGPLUG_DIAGNOSE_EVERY")
    steps = None
    if every is not None:
        if not every.isdigit() or int(every) < 1:
            raise ValueError(
                f"RINGPLUG_DIAGNOSE_EVERY={every!r} must be a positive number of steps."
            )
        steps = int(every)
    return (None if raw is None else words[raw.lower()]), steps


def elastic_setting() -> tuple[int, str | None, str | None]:
    """What a rank of an elastic job needs to resume: ``RINGPLUG_RESTART`` (which start of
    the job this is, 0 for the first), ``RINGPLUG_JOB_ID`` (the same in every start of one
    ``ringrun`` job; None outside one) and ``RINGPLUG_ELASTIC_DIR`` (where commits are kept,
    e.g. a shared filesystem; None for the default under the temporary directory)."""
    raw = _env("RINGPLUG_RESTART")
    if raw is not None and not raw.isdigit():
        raise ValueError(f"RINGPLUG_RESTART={raw!r} must be a whole number (ringrun sets it).")
    return (
        (int(raw) if raw is not None else 0),
        _env("RINGPLUG_JOB_ID"),
        _env("RINGPLUG_ELASTIC_DIR"),
    )
