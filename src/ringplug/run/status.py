"""Rank reports: the files the per-rank wrapper writes and ``ringrun`` reads.

Two kinds live in a job's status directory: a failure report (``rank-<rank>-<pid>.json``)
when a rank's program did not exit cleanly, and, when ``ringrun --start-timeout`` asks for
them, a start marker (``rank-<rank>-<pid>.started``) as soon as the wrapper has started the
program.

Standard library only: the wrapper imports this inside every rank, before the user's
program, and must stay light (no mpi4py, no ``ringplug.core``).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

STATUS_DIR_VARIABLE = "RINGPLUG_RUN_STATUS_DIR"
"""Environment variable naming the directory where ranks report how they failed."""

START_MARKERS_VARIABLE = "RINGPLUG_RUN_START_MARKERS"
"""Environment variable that, set to ``1``, asks the wrappers for start markers."""

_SUFFIX = ".json"
_START_SUFFIX = ".started"


@dataclass(frozen=True)
class RankStatus:
    """How one rank ended when it did not exit cleanly.

    Args:
        rank: the rank's number in the job, ``None`` when the launcher did not say.
        host: hostname of the machine it ran on.
        pid: process id of the user's program (not the wrapper).
        exit_code: its exit code, or ``None`` when a signal ended it.
        signal_name: ``"SIGKILL"`` and the like when a signal ended it, else ``None``.
        timestamp: seconds since the epoch when the wrapper saw it end.
    """

    rank: int | None
    host: str
    pid: int
    exit_code: int | None
    signal_name: str | None
    timestamp: float

    def describe(self) -> str:
        """One line for people: which rank, where, and how it ended."""
        who = "a rank" if self.rank is None else f"rank {self.rank}"
        if self.signal_name is not None:
            how = f"was killed by signal {self.signal_name}"
        else:
            how = f"exited with code {self.exit_code}"
        return f"{who} on host {self.host} (pid {self.pid}) {how}"

    @property
    def shell_exit_code(self) -> int:
        """The exit code a shell would report for it: the code, or 128 + signal number."""
        if self.signal_name is not None:
            try:
                return 128 + int(signal.Signals[self.signal_name])
            except KeyError:
                return 1
        return self.exit_code if self.exit_code else 1


def signal_name(number: int) -> str:
    """``9`` -> ``"SIGKILL"``; numbers without a name become ``"signal 42"``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def write_status(directory: str | Path, status: RankStatus) -> Path:
    """Write ``status`` into ``directory`` so a reader never sees a half-written file."""
    directory = Path(directory)
    name = f"rank-{status.rank if status.rank is not None else 'unknown'}-{status.pid}"
    final = directory / (name + _SUFFIX)
    partial = directory / (name + ".partial")
    partial.write_text(json.dumps(asdict(status)))
    os.replace(partial, final)
    return final


def read_statuses(directory: str | Path) -> list[RankStatus]:
    """All complete reports in ``directory``, earliest first."""
    statuses = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.name.endswith(_SUFFIX):
            continue
        try:
            statuses.append(RankStatus(**json.loads(Path(entry.path).read_text())))
        except (OSError, ValueError, TypeError):
            # A report we cannot read must not hide the ones we can.
            continue
    return sorted(statuses, key=lambda status: status.timestamp)


def has_statuses(directory: str | Path) -> bool:
    """Whether any rank has reported a failure yet (cheap enough to poll)."""
    try:
        return any(entry.name.endswith(_SUFFIX) for entry in os.scandir(directory))
    except FileNotFoundError:
        return False


def write_start_marker(directory: str | Path, rank: int, host: str, pid: int) -> Path:
    """Record that ``rank`` started its program on ``host`` as process ``pid``.

    The file's name carries the rank, so :func:`started_ranks` needs no parsing of contents;
    the contents are there for people looking into the directory.
    """
    directory = Path(directory)
    name = f"rank-{rank}-{pid}"
    final = directory / (name + _START_SUFFIX)
    partial = directory / (name + ".partial")
    partial.write_text(json.dumps({"rank": rank, "host": host, "pid": pid}))
    os.replace(partial, final)
    return final


def started_ranks(directory: str | Path) -> set[int]:
    """Ranks that have left a start marker in ``directory`` (cheap enough to poll)."""
    ranks = set()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return set()
    for entry in entries:
        if not entry.name.endswith(_START_SUFFIX):
            continue
        number = entry.name.split("-")[1]
        if number.isdigit():
            ranks.add(int(number))
    return ranks
