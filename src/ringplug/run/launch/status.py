"""Rank events: what the per-rank wrapper tells ``ringrun``, and how it travels.

The wrapper reports two things: that it started the rank's program, and how it ended (a
clean exit too: a rank that leaves early with code 0 is named when the job then fails). A
rank that ringplug ends because of another rank (a peer that stopped answering, failed a
collective or left) reports a *fault* naming those ranks, so ringrun names the root cause
rather than the rank that gave up first. Both travel as one line on the wrapper's stderr, which
the MPI launcher carries back to ``ringrun`` from every host, over the same connections
that carry the ranks' output. Nothing is written to disk, so ranks on other hosts report
exactly as local ones do, without a shared filesystem.

An event line reads ``ringrun-event:<token> {json}``. The token is random per job (ringrun
hands it to the ranks in ``RINGPLUG_RUN_EVENTS``, ``ringplug.wire``), so a program that
prints something similar is never mistaken for the wrapper; the launcher may put its rank
prefix (``[3] ``) in front. ringrun removes event lines from the output it passes on.

The wrapper imports this inside every rank, before the user's program, and must stay light:
no mpi4py. The event names come from the wire vocabulary (``ringplug.wire``), which
imports only the standard library: the core and numpy stay out.
"""

from __future__ import annotations

import base64
import binascii
import json
import signal
from dataclasses import dataclass
from typing import Any

from ringplug import wire  # the event names, spelled once for ranks and ringrun
from ringplug.forensics.stacks import ProcessStacks


@dataclass(frozen=True)
class RankStatus:
    """How one rank ended when it did not exit cleanly.

    Args:
        rank: the rank's number in the job, ``None`` when the launcher did not say.
        host: hostname of the machine it ran on.
        pid: process id of the user's program (not the wrapper).
        exit_code: its exit code, or ``None`` when a signal ended it.
        signal_name: ``"SIGKILL"`` and the like when a signal ended it, else ``None``.
        timestamp: seconds since the epoch when the wrapper saw it end (by that host's
            clock; ringrun compares it only between reports that arrived together).
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
    def clean(self) -> bool:
        """Whether the program exited with code 0 (not a failure by itself)."""
        return self.signal_name is None and self.exit_code == 0

    @property
    def shell_exit_code(self) -> int:
        """The exit code a shell would report for it: the code, or 128 + signal number."""
        if self.signal_name is not None:
            try:
                return 128 + int(signal.Signals[self.signal_name])
            except KeyError:
                return 1
        return self.exit_code if self.exit_code else 1

    def to_event(self) -> dict[str, Any]:
        """The ``exited`` event that carries this status."""
        return {
            "event": wire.EXITED,
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "signal_name": self.signal_name,
            "timestamp": self.timestamp,
        }

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> RankStatus:
        """The status an ``exited`` event carries.

        Raises:
            ValueError: the event lacks a field or has one of the wrong type.
        """
        try:
            return cls(
                rank=None if event["rank"] is None else int(event["rank"]),
                host=str(event["host"]),
                pid=int(event["pid"]),
                exit_code=None if event["exit_code"] is None else int(event["exit_code"]),
                signal_name=None if event["signal_name"] is None else str(event["signal_name"]),
                timestamp=float(event["timestamp"]),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a rank status: {event!r}") from error


@dataclass(frozen=True)
class RankStarted:
    """A rank whose wrapper has started the program.

    Args:
        rank: the rank's number in the job, ``None`` when the launcher did not say.
        host: hostname of the machine it runs on.
        pid: process id of the user's program.
    """

    rank: int | None
    host: str
    pid: int

    def to_event(self) -> dict[str, Any]:
        """The ``started`` event that carries this fact."""
        return {"event": wire.STARTED, "rank": self.rank, "host": self.host, "pid": self.pid}

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> RankStarted:
        """The fact a ``started`` event carries.

        Raises:
            ValueError: the event lacks a field or has one of the wrong type.
        """
        try:
            rank = event["rank"]
            return cls(None if rank is None else int(rank), str(event["host"]), int(event["pid"]))
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a start report: {event!r}") from error


@dataclass(frozen=True)
class RankFault:
    """Why ringplug ended a rank, as the rank itself said.

    Args:
        rank: the rank that ended.
        culprits: the other ranks that caused it (stopped answering, failed a collective,
            left the job); empty when the cause is on this rank (an uncaught exception).
        message: the line the rank printed.
        timestamp: seconds since the epoch, by that rank's host clock.
    """

    rank: int
    culprits: tuple[int, ...]
    message: str
    timestamp: float

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> RankFault:
        """The fault a ``fault`` event carries.

        Raises:
            ValueError: the event lacks a field or has one of the wrong type.
        """
        try:
            culprits = tuple(int(rank) for rank in event["culprits"])
            return cls(
                int(event["rank"]), culprits, str(event["message"]), float(event["timestamp"])
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a rank fault: {event!r}") from error


@dataclass(frozen=True)
class RankOutput:
    """Bytes a rank's program wrote to a terminal, passed on to ringrun's own unchanged.

    When ringrun's output is a terminal, rank 0's program writes to a pseudo-terminal and
    its wrapper sends what it reads there as these events, so that carriage returns and
    cursor moves (progress bars) reach ringrun's terminal as written, neither split nor
    prefixed by the launcher (see :mod:`ringplug.run.launch.terminal`).

    Args:
        rank: the rank that wrote them.
        data: the bytes, as the program wrote them.
    """

    rank: int
    data: bytes

    def to_event(self) -> dict[str, Any]:
        """The ``output`` event that carries these bytes (base64: any bytes, one line)."""
        return {
            "event": wire.OUTPUT,
            "rank": self.rank,
            "data": base64.b64encode(self.data).decode(),
        }

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> RankOutput:
        """The bytes an ``output`` event carries.

        Raises:
            ValueError: the event lacks a field or has one of the wrong type.
        """
        try:
            return cls(int(event["rank"]), base64.b64decode(event["data"], validate=True))
        except (KeyError, TypeError, binascii.Error) as error:
            raise ValueError(f"not a rank's output: {event!r}") from error


@dataclass(frozen=True)
class RankStacks:
    """Where a rank is: its stacks, sent by the rank itself (ringplug saw a stall) or by its
    wrapper (the rank ran no Python for too long, or ringrun asked: `reason` "requested").

    Args:
        rank: the rank.
        host: its host.
        reason: why the stacks were taken.
        report: the stacks (`ringplug.forensics.stacks.ProcessStacks`).
    """

    rank: int
    host: str
    reason: str
    report: ProcessStacks

    def to_event(self) -> dict[str, Any]:
        return {
            "event": wire.STACKS,
            "rank": self.rank,
            "host": self.host,
            "reason": self.reason,
            "report": self.report.to_dict(),
        }

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> RankStacks:
        """The stacks a ``stacks`` event carries.

        Raises:
            ValueError: the event lacks a field or has one of the wrong type.
        """
        try:
            report = ProcessStacks.from_dict(event["report"])
            return cls(int(event["rank"]), str(event["host"]), str(event["reason"]), report)
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a stack report: {event!r}") from error


@dataclass(frozen=True)
class RankFlight:
    """A rank's flight record (its last collectives), for the job's flight file.

    Args:
        rank: the rank.
        record: host, reason, time written and the records, as the rank sent them.
    """

    rank: int
    record: dict[str, Any]

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> RankFlight:
        """The record a ``flight`` event carries.

        Raises:
            ValueError: the event lacks a field or has one of the wrong type.
        """
        try:
            record = {k: event[k] for k in ("host", "reason", "written", "records")}
            if not isinstance(record["records"], list):
                raise TypeError("records is not a list")
            return cls(int(event["rank"]), record)
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a flight record: {event!r}") from error


Event = RankStatus | RankStarted | RankFault | RankOutput | RankStacks | RankFlight
"""Anything a wrapper reports to ringrun."""


def signal_name(number: int) -> str:
    """``9`` -> ``"SIGKILL"``; numbers without a name become ``"signal 42"``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def event_line(token: str, event: dict[str, Any]) -> bytes:
    """The line the wrapper writes for ``event``, newline included."""
    return f"{wire.EVENT_MARK}{token} {json.dumps(event, separators=(',', ':'))}\n".encode()


def parse_event(line: str, token: str) -> Event | None:
    """The event in ``line`` if it is one of this job's event lines, else ``None``.

    The line may carry a launcher's rank prefix before the mark. A line with the mark and
    token but an unreadable event is also ``None``; ringrun passes it on like output.
    """
    mark = f"{wire.EVENT_MARK}{token} "
    start = line.find(mark)
    if start < 0:
        return None
    try:
        event = json.loads(line[start + len(mark) :])
        if not isinstance(event, dict):
            return None
        if event.get("event") == wire.STARTED:
            return RankStarted.from_event(event)
        if event.get("event") == wire.EXITED:
            return RankStatus.from_event(event)
        if event.get("event") == wire.FAULT:
            return RankFault.from_event(event)
        if event.get("event") == wire.OUTPUT:
            return RankOutput.from_event(event)
        if event.get("event") == wire.STACKS:
            return RankStacks.from_event(event)
        if event.get("event") == wire.FLIGHT:
            return RankFlight.from_event(event)
    except ValueError:
        return None
    return None
