"""What this rank's training is doing now, so a stall report can say why a rank is missing.

Framework adapters name the phase as they enter it (``set_phase("waiting for data")``) and
where in training the rank is (``set_position(epoch=0, batch=17, step=17)``); the engine
puts the phase, with the position, and how long the rank has been in it into every
negotiation message, and the stall inspector quotes the missing ranks' last phase ("rank 1
was in forward/backward at epoch 0, batch 17 (step 17) for 61 s"). Setting a phase is one
list store and one clock read, setting the position one tuple stored: cheap enough for
every step of every fit. The words are made in `current`, once per phase and position.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

WAITING_FOR_DATA = "waiting for data"
COMPUTING = "in forward/backward"
IN_TRAIN_STEP = "in the train step"  # a framework's own step: fetch, forward and backward
REDUCING = "waiting for gradient reduction"
STEPPING = "in the optimizer step"
BETWEEN_STEPS = "between steps"
OUT_OF_DATA = "done with its data"
PREPARING_DATA = "in prepare_data"

MAX_BYTES = 255  # of a phase with its position: what the compact wire form keeps (exchange.py)

# [phase, monotonic time it began, position: (epoch, batch, step), each an int or None; or
# None when no position is known]
_phase: list = ["", time.monotonic(), None]
# The (phase, position) `current` last put into words, and the words: reused while neither
# changes (compared by identity, so a new position tuple is worded again).
_worded: list = [("", None, "")]


def set_phase(phase: str) -> None:
    """Record that this rank's training thread has entered `phase` (a short phrase)."""
    _phase[0] = phase
    _phase[1] = time.monotonic()


def set_position(
    epoch: int | None = None, batch: int | None = None, step: int | None = None
) -> None:
    """Record where in training this rank is: the `epoch`, the `batch` index within it and
    the optimizer `step` (counted over the whole training), each ``None`` when not known.
    They stay until the next call; with no arguments the position is forgotten (the end of
    a fit). The phase keeps its start: a new batch is no new phase."""
    _phase[2] = None if epoch is None and batch is None and step is None else (epoch, batch, step)


def count_step() -> None:
    """One more optimizer step is done: the position's step goes up by one (from 0 when
    none was known), its epoch and batch stay as they are."""
    position = _phase[2]
    if position is None:
        _phase[2] = (None, None, 1)
    else:
        epoch, batch, step = position
        _phase[2] = (epoch, batch, 1 if step is None else step + 1)


def current() -> tuple[str, float]:
    """This rank's phase, with its position when one is known ("in forward/backward at
    epoch 0, batch 17 (step 17)"; at most `MAX_BYTES` bytes as UTF-8), and the seconds it
    has been in the phase (``("", ...)`` when unknown)."""
    phase, began, position = _phase
    if position is not None and phase:
        worded = _worded[0]
        if worded[0] is not phase or worded[1] is not position:
            worded = (phase, position, _with_position(phase, position))
            _worded[0] = worded  # one store: the cycle thread and the training thread read it
        phase = worded[2]
    return phase, time.monotonic() - began


def _where(position: tuple[int | None, int | None, int | None]) -> str:
    """`position` in words: "at epoch 0, batch 17 (step 17)", "at step 5" ("" when empty)."""
    epoch, batch, step = position
    parts = [f"epoch {epoch}"] if epoch is not None else []
    if batch is not None:
        parts.append(f"batch {batch}")
    if step is None:
        return f"at {', '.join(parts)}" if parts else ""
    return f"at {', '.join(parts)} (step {step})" if parts else f"at step {step}"


def _with_position(phase: str, position: tuple[int | None, int | None, int | None]) -> str:
    """`phase` and `position` in one phrase of at most MAX_BYTES bytes: a long phase is cut
    so that the position is still sent."""
    suffix = _where(position)
    if not suffix:
        return phase
    text = f"{phase} {suffix}"
    if len(text) * 4 <= MAX_BYTES or len(text.encode()) <= MAX_BYTES:
        return text
    room = max(MAX_BYTES - len(suffix.encode()) - 1, 0)
    return f"{phase.encode()[:room].decode(errors='ignore')} {suffix}"


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
