"""The one place that reads ringplug's environment variables."""

from __future__ import annotations

import dataclasses
import os

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """Parse a byte count such as "65536", "64K", "16M", "1G" or "16MiB"."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _UNITS else ""
    number = value[: len(value) - len(unit)] if unit else value
    try:
        result = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(
            f"Cannot read {text!r} as a byte count; write e.g. 65536, 64K or 16M."
        ) from None
    if result < 0:
        raise ValueError(f"Byte count {text!r} must not be negative.")
    return result


@dataclasses.dataclass(frozen=True)
class Settings:
    """Knobs read from `RINGPLUG_*` variables; constructor arguments elsewhere win over these."""

    # Seconds a collective may wait for its peers before the job is aborted.
    timeout: float = 1800.0
    # From this many bytes on, allreduce uses ringplug's ring instead of MPI's own Allreduce.
    # Measured on the 2-core CI machine, 2 ranks: MPICH's Allreduce is as fast as the ring
    # up to 8-16 MiB and falls to half the ring's bandwidth from 32 MiB (it page-faults a
    # fresh temporary every call).
    ring_threshold: int = 8 << 20
    # Bytes per ring pipeline segment: small enough that received data is still in the L2
    # cache when it is reduced (256 KiB to 2 MiB measured alike at 64 MiB; 512 KiB best).
    ring_segment: int = 512 << 10
    # Allreduces of one dtype and op that are ready together are packed into one buffer of
    # at most this many bytes and reduced in one pass.
    fusion_threshold: int = 64 << 20
    # Seconds the engine waits after a submission for more requests to fuse with (0: run
    # each cycle with what has arrived; requests that arrive meanwhile form the next one).
    cycle_time: float = 0.0
    # Rank 0 warns about collectives some ranks submitted and others did not after this
    # long, and (if > 0) every rank raises after the shutdown period.
    stall_check_seconds: float = 60.0
    stall_shutdown_seconds: float = 0.0
    # Chrome trace of the engine (written by rank 0), or None.
    timeline: str | None = None
    log_level: str = "WARNING"


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _float(name: str, default: float, allow_zero: bool = False, unit: str = "seconds") -> float:
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of {unit}.") from None
    if value < 0 or (value == 0 and not allow_zero):
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name}={raw!r} must be {kind} number of {unit}.")
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
        timeout=_float("RINGPLUG_TIMEOUT", defaults.timeout),
        ring_threshold=_bytes("RINGPLUG_RING_THRESHOLD", defaults.ring_threshold),
        ring_segment=segment,
        fusion_threshold=_bytes("RINGPLUG_FUSION_THRESHOLD", defaults.fusion_threshold),
        cycle_time=_float("RINGPLUG_CYCLE_TIME", 0.0, True, "milliseconds") / 1e3,
        stall_check_seconds=_float("RINGPLUG_STALL_CHECK_SECONDS", defaults.stall_check_seconds),
        stall_shutdown_seconds=_float(
            "RINGPLUG_STALL_SHUTDOWN_SECONDS", defaults.stall_shutdown_seconds, True
        ),
        timeline=_env("RINGPLUG_TIMELINE"),
        log_level=(_env("RINGPLUG_LOG_LEVEL") or defaults.log_level).upper(),
    )
