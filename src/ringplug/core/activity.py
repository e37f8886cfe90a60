"""What this rank's training is doing now, so a stall report can say why a rank is missing.

Framework adapters name the phase as they enter it (``set_phase("waiting for data")``);
the engine puts the phase and how long the rank has been in it into every negotiation
message, and the stall inspector quotes the missing ranks' last phase. Setting a phase is
one list store and one clock read: cheap enough for every step of every fit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

WAITING_FOR_DATA = "waiting for data"
COMPUTING = "in forward/backward"
REDUCING = "waiting for gradient reduction"
STEPPING = "in the optimizer step"
BETWEEN_STEPS = "between steps"
OUT_OF_DATA = "done with its data"
PREPARING_DATA = "in prepare_data"

_phase: list = ["", time.monotonic()]  # [phase, monotonic time it began]


def set_phase(phase: str) -> None:
    """Record that this rank's training thread has entered `phase` (a short phrase)."""
    _phase[0] = phase
    _phase[1] = time.monotonic()


def current() -> tuple[str, float]:
    """This rank's phase and the seconds it has been in it (``("", ...)`` when unknown)."""
    return _phase[0], time.monotonic() - _phase[1]


def describe(
    ranks: Sequence[int],
    activities: Sequence[tuple[str, float]],
    partial: Mapping[str, Sequence[int]],
) -> str:
    """What the `ranks` missing from a collective were last doing, as one sentence part
    (empty when none of them named a phase: a program without a framework adapter).

    `activities` is every rank's `current()` as its last negotiation message carried it;
    `partial` names the collectives some ranks have ready (and which ranks), so a missing
    rank that waits in a different collective is shown waiting there.
    """
    parts = []
    for rank in ranks:
        phase, seconds = activities[rank] if rank < len(activities) else ("", 0.0)
        elsewhere = sorted(name for name, holders in partial.items() if rank in holders)
        if elsewhere:
            shown = ", ".join(repr(n) for n in elsewhere[:3]) + (
                ", ..." if len(elsewhere) > 3 else ""
            )
            parts.append(
                f"rank {rank} waits in a different collective ({shown}"
                + (f"; last phase: {phase})" if phase else ")")
            )
        elif phase:
            parts.append(f"rank {rank} was {phase} for {seconds:.0f} s")
    return "; ".join(parts)  # "" when no missing rank said anything
