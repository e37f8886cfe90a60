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
    # Allreduce/broadcast payloads up to this many bytes travel with the metadata exchange
    # and are reduced locally: one message round, mismatch check included. Measured on the
    # 2-core CI machine, 2 ranks: faster than the metadata exchange followed by MPICH's
    # Allreduce up to 64 KiB (8.3 vs 12.9 us at 4 KiB), slower from 128 KiB.
    eager_threshold: int = 64 << 10
    # From this many bytes on, allreduce uses ringplug's ring instead of MPI's own Allreduce.
    # Same machine: MPICH's Allreduce is as fast as the ring up to 8-16 MiB and falls to
    # half the ring's bandwidth from 32 MiB (it page-faults a fresh temporary every call).
    ring_threshold: int = 8 << 20
    # Bytes per ring pipeline segment: small enough that received data is still in the L2
    # cache when it is reduced (256 KiB to 2 MiB measured alike at 64 MiB; 512 KiB best).
    ring_segment: int = 512 << 10
    log_level: str = "WARNING"


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _float(name: str, default: float) -> float:
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds.") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds.")
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
        eager_threshold=_bytes("RINGPLUG_EAGER_THRESHOLD", defaults.eager_threshold),
        ring_threshold=_bytes("RINGPLUG_RING_THRESHOLD", defaults.ring_threshold),
        ring_segment=segment,
        log_level=(_env("RINGPLUG_LOG_LEVEL") or defaults.log_level).upper(),
    )
