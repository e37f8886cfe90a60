"""ringrun's side of "where is it stuck": the ranks' stacks and flight records.

- A stall report (a rank ringplug asked, or a wrapper whose rank stopped running Python)
  arrives as a ``stacks`` event and is printed at once, the rank named.
- On demand (SIGUSR1 to ringrun, or ``ringrun --stacks [PID]`` through the job's socket)
  ringrun sends SIGUSR1 to the launcher, which passes it to every rank's wrapper on every
  host; each wrapper answers with its rank's stacks taken from outside, and ringrun prints
  them grouped (ranks stuck alike once), after every rank answered or `ROUND_SECONDS`.
- ``flight`` events (each rank's last collectives) go into one file per job, whose path
  ringrun prints once; ``ringrun --explain FILE`` reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from ringplug import config
from ringplug.forensics.stacks import (
    ProcessStacks,
    body_lines,
    grouped_lines,
    process_line,
    rank_ranges,
)

ROUND_SECONDS = 4.0  # how long an on-demand request waits for the ranks' answers
REQUESTED = "requested"  # the reason wrappers give for an on-demand report
_ASK = b"stacks\n"


def socket_folder() -> Path:
    """Where running ringruns of this user listen for ``ringrun --stacks``."""
    return Path(tempfile.gettempdir()) / f"ringrun-{os.getuid()}"


def _say(lines: list[str], stream: Any = None) -> None:
    out = stream or sys.stderr
    with contextlib.suppress(OSError, ValueError):
        out.write("".join(f"ringrun: {line}\n" for line in lines))
        out.flush()


class StackDesk:
    """The running job's desk for stack reports: prints stall reports, answers requests.

    Args:
        ask_ranks: sends the request on to every rank (SIGUSR1 to the launcher).
        expected: the ranks that should answer now (started, not yet ended).
        hosts: each rank's host, for headers.
    """

    def __init__(
        self,
        ask_ranks: Callable[[], None],
        expected: Callable[[], Collection[int]],
        hosts: Callable[[], dict[int, str]],
    ) -> None:
        self.ask_ranks = ask_ranks
        self.expected = expected
        self.hosts = hosts
        self._lock = threading.Lock()
        self._requesters: list[socket.socket | None] = []  # None: SIGUSR1, print here
        self._round_until: float | None = None
        self._answers: dict[int, ProcessStacks] = {}
        self._server: socket.socket | None = None
        self.path: Path | None = None

    # -------------------------------------------------------------- requests
    def listen(self) -> None:
        """Serve ``ringrun --stacks`` on this process's socket (best effort)."""
        folder = socket_folder()
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            path = folder / f"{os.getpid()}.sock"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(str(path))
            server.listen(4)
        except OSError:
            return  # no socket: SIGUSR1 still works
        self._server, self.path = server, path
        threading.Thread(target=self._accept, name="ringrun-stacks", daemon=True).start()

    def _accept(self) -> None:
        server = self._server
        while server is not None:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            connection.settimeout(2.0)
            try:
                asked = connection.recv(64)
            except OSError:
                asked = b""
            if asked != _ASK:
                connection.close()
                continue
            with self._lock:
                self._requesters.append(connection)

    def on_signal(self) -> None:
        """SIGUSR1 to ringrun: print every rank's stacks here (safe in a signal handler)."""
        self._requesters.append(None)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
        self._finish_round("the job ended before every rank answered")

    # -------------------------------------------------------------- events
    def on_stacks(self, rank: int, host: str, reason: str, report: ProcessStacks) -> None:
        """A rank's stacks: an answer to a request, or a stall report to print now."""
        with self._lock:
            if reason == REQUESTED:
                if self._round_until is not None:
                    self._answers[rank] = report
                return
        lines = [f"where rank {rank} (host {host}) is: {reason}", f"  {process_line(report)}"]
        lines += body_lines(report)
        _say(lines)

    def poll(self, now: float) -> None:
        """From ringrun's supervising loop: start a round for new requests, end one that
        every rank answered or whose time is up."""
        with self._lock:
            start = self._round_until is None and bool(self._requesters)
            if start:
                self._round_until = now + ROUND_SECONDS
                self._answers = {}
        if start:
            self.ask_ranks()
            return
        if self._round_until is None:
            return
        expected = set(self.expected())
        if expected <= set(self._answers) or now >= self._round_until:
            self._finish_round("")

    def _finish_round(self, why: str) -> None:
        with self._lock:
            if self._round_until is None:
                return
            answers, self._answers = self._answers, {}
            requesters, self._requesters = self._requesters, []
            self._round_until = None
        silent = sorted(set(self.expected()) - set(answers))
        lines = [
            f"stacks of {len(answers)} rank{'s' if len(answers) != 1 else ''}, taken just now:"
        ]
        lines += grouped_lines(answers, self.hosts()) if answers else []
        if silent:
            lines.append(
                f"rank{'s' if len(silent) > 1 else ''} {rank_ranges(silent)} did not answer within "
                f"{ROUND_SECONDS:g} s{f' ({why})' if why else ''}: its wrapper or host is gone, "
                "or the rank was started without ringrun's wrapper"
            )
        text = "".join(f"{line}\n" for line in lines)
        for requester in requesters:
            if requester is None:
                _say(lines)
                continue
            with contextlib.suppress(OSError):
                requester.sendall(text.encode())
            requester.close()


def request_stacks(target: str | None, timeout: float = 10.0) -> int:
    """``ringrun --stacks [PID]``: print the stacks of a running job (by its ringrun's pid;
    without one, the only ringrun of this user that runs)."""
    folder = socket_folder()
    if target:
        if not target.isdigit():
            print(
                f"ringrun: error: --stacks takes ringrun's process id, not {target!r}",
                file=sys.stderr,
            )
            return 2
        path = folder / f"{target}.sock"
        if not path.exists():
            print(
                f"ringrun: error: no running ringrun with pid {target} serves stack requests "
                f"(no {path}); is it this user's, on this machine?",
                file=sys.stderr,
            )
            return 1
    else:
        running = sorted(folder.glob("*.sock")) if folder.is_dir() else []
        running = [p for p in running if _alive(p.stem)]
        if len(running) != 1:
            which = ", ".join(p.stem for p in running) or "none"
            print(
                f"ringrun: error: --stacks needs the pid of the ringrun to ask (running: {which})",
                file=sys.stderr,
            )
            return 1
        path = running[0]
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)
            connection.connect(str(path))
            connection.sendall(_ASK)
            chunks = []
            while time.monotonic() < deadline:
                chunk = connection.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
    except OSError as error:
        print(f"ringrun: error: could not ask ringrun {path.stem}: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(b"".join(chunks).decode(errors="replace"))
    sys.stdout.flush()
    return 0


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


class FlightFile:
    """The job's flight records, one file, rewritten as each rank's arrives."""

    def __init__(self, path: Path | None = None) -> None:
        folder = config.FLIGHT_DIR.read() or tempfile.gettempdir()
        self.path = path or Path(folder) / f"ringrun-flight.{os.getpid()}.json"
        self.ranks: dict[str, dict[str, Any]] = {}

    def add(self, rank: int, record: dict[str, Any]) -> None:
        first = not self.ranks
        self.ranks[str(rank)] = record
        temporary = self.path.with_name(f".{self.path.name}")
        try:
            temporary.write_text(json.dumps({"ranks": self.ranks}, indent=1))
            temporary.replace(self.path)
        except OSError as error:
            if first:
                _say([f"could not write the flight records to {self.path}: {error}"])
            return
        if first:
            explain = f"`ringrun --explain {self.path}` says where they parted"
            _say([f"flight records of the ranks: {self.path} ({explain})"])
