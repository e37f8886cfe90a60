"""Rank-prefixed logging: quiet on ranks other than 0 unless RINGPLUG_LOG_LEVEL says otherwise."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .. import config, wire

_HANDLER_NAME = "ringplug"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.ringplug_rank = self.rank
        return True


def configure(rank: int, level: str | None) -> None:
    """Attach one stderr handler to the `ringplug` logger, prefixed with this rank.

    Rank 0 logs at `level` (WARNING unless RINGPLUG_LOG_LEVEL is set); other ranks log
    errors only unless the level was set explicitly, so N ranks don't print N copies.
    """
    logger = logging.getLogger("ringplug")
    for handler in list(logger.handlers):
        if handler.get_name() == _HANDLER_NAME:
            logger.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(
        logging.Formatter("ringplug[%(ringplug_rank)d] %(levelname)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    explicit = config.LOG_LEVEL.given()
    if rank == 0 or explicit:
        logger.setLevel((level or "WARNING").upper())
    else:
        logger.setLevel(logging.ERROR)
    logger.propagate = False


# Called with the fatal message before `end_job` ends the rank (the engine's flight record).
before_end: list[Callable[[str], None]] = []


def _event_line(kind: str, fields: dict[str, Any]) -> str:
    """The event line ringrun reads (see `ringplug.run.launch.status`), or "" when not under it."""
    token = os.environ.get(wire.EVENTS_VARIABLE)
    if not token:
        return ""
    body = json.dumps({"event": kind, **fields}, separators=(",", ":"))
    return f"{wire.EVENT_MARK}{token} {body}\n"


def event(kind: str, **fields: Any) -> bool:
    """Send ringrun an event of `kind` (a stall's stacks, a flight record) on the real
    stderr; False when not under ringrun (nothing sent)."""
    line = _event_line(kind, fields)
    if not line:
        return False
    stream = sys.__stderr__ or sys.stderr
    with contextlib.suppress(OSError, ValueError):
        stream.write(line)
        stream.flush()
    return True


def _leave_fault_file(fault: dict[str, Any]) -> None:
    """Under ringrun, the fault for the rank's wrapper to relay too: a program whose file
    descriptor 2 is captured (pytest's default) would otherwise end without ringrun hearing
    why."""
    folder = os.environ.get(wire.STACKS_DIR_VARIABLE)
    if not folder or not os.environ.get(wire.EVENTS_VARIABLE):
        return
    path = os.path.join(folder, wire.FAULT_FILE)
    with contextlib.suppress(OSError, ValueError):
        with open(f"{path}.{os.getpid()}", "w", encoding="utf-8") as file:
            json.dump({"event": wire.FAULT, **fault}, file)
        os.replace(f"{path}.{os.getpid()}", path)  # whole, or not at all


def say(rank: int, lines: Sequence[str]) -> None:
    """Write `lines` to the real stderr at once, each prefixed with this rank, whatever
    the log level (a stall report on a rank other than 0)."""
    stream = sys.__stderr__ or sys.stderr
    with contextlib.suppress(OSError, ValueError):
        stream.write("".join(f"ringplug[{rank}] {line}\n" for line in lines))
        stream.flush()


def end_job(
    rank: int,
    message: str,
    culprits: Sequence[int] = (),
    linger: float = 0.0,
    last_words: bool = True,
) -> NoReturn:
    """Print a fatal `message` and end this rank without finalizing MPI.

    `culprits` are the other ranks that caused it (empty: the cause is on this rank).
    Under ringrun the rank also reports both, so that the job's summary names the root
    cause rather than whichever rank gave up first.

    Not MPI_Abort: it kills the job before this rank's last output reaches the launcher.
    A rank that leaves without MPI_Finalize makes the launcher (hydra, Open MPI, ringrun)
    tear the whole job down, after its output is through.

    With `last_words` the `before_end` callbacks run first (the flight record).

    `linger` seconds it waits first for the launcher to end it (a peer that left the job
    is exiting with its own code, which the launcher must see first).
    """
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    for say_last in list(before_end) if last_words else []:
        with contextlib.suppress(Exception):
            say_last(message)
    # The real stderr: a wrapping excepthook may have pointed sys.stderr at a buffer.
    stream = sys.__stderr__ or sys.stderr
    fault = {
        "rank": rank,
        "culprits": sorted(set(culprits)),
        "message": message,
        "timestamp": time.time(),
    }
    _leave_fault_file(fault)
    lines = f"ringplug[{rank}] FATAL: {message}\n" + _event_line(wire.FAULT, fault)
    with contextlib.suppress(OSError, ValueError):
        stream.write(lines)
        stream.flush()
    if linger > 0:
        time.sleep(linger)  # the launcher usually ends this process before
    os._exit(1)
