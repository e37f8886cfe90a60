"""Running a launch plan: start the MPI launcher, watch its ranks, tear the job down.

The launcher runs in its own session so ringrun can signal its whole process group. Its
stdout and stderr come back to ringrun through pipes: ringrun passes the output on, takes
out the rank events the wrappers write (see :mod:`ringplug.run.launch.status`), and reads ssh's
complaints about hosts. The launcher carries all of it from every host, so a rank on another
machine reports like a local one, with no shared filesystem.

The first failure a rank reports starts a teardown that is bounded in time: a grace period
in which the launcher may end the job itself, then SIGTERM to its process group, then
SIGKILL. Ranks that outlive their launcher are killed by their wrapper when the launcher's
proxy on their host kills it or ends (on other hosts, when the launcher's connection to them
closes), and every process a rank started ends with it (:mod:`ringplug.run.launch.tree`).

With a :class:`StartWatch`, ranks that have not reported starting their program when its
timeout ends stop the job the same way, without the launcher's grace period (the launcher
does not know anything is wrong).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import BinaryIO

from ringplug import wire
from ringplug.run.hosts.ssh import HostProblem, LaunchDiagnosis
from ringplug.run.launch.hints import hint_for
from ringplug.run.launch.mpi import LaunchPlan
from ringplug.run.launch.processes import parent_death_signal, pump_lines, write_all
from ringplug.run.launch.stacks import FlightFile, StackDesk
from ringplug.run.launch.status import (
    Event,
    RankFault,
    RankFlight,
    RankOutput,
    RankStacks,
    RankStarted,
    RankStatus,
    parse_event,
)
from ringplug.run.launch.terminal import TerminalSink, TerminalSpec, terminal_sinks

logger = logging.getLogger(__name__)

START_TIMEOUT_EXIT_CODE = 124
"""ringrun's exit code when ranks did not start in time (as ``timeout(1)`` uses it)."""

START_FAILED_EXIT_CODE = 255
"""ringrun's exit code when ranks could not be started on a host (as ssh uses it)."""

# How long the output may keep flowing after the launcher exited (a helper may hold it).
_DRAIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Teardown:
    """How patiently a failed job is stopped; the sum bounds the time to stop every rank.

    Args:
        poll_interval_s: how often the launcher and the rank events are checked.
            Defaults to 0.1.
        launcher_grace_s: time the launcher gets to end the job itself after the first
            failure (Open MPI does; hydra waits for the remaining ranks). Defaults to 2.0.
        terminate_grace_s: time between SIGTERM and SIGKILL to the launcher's process
            group. Defaults to 3.0.
        signal_grace_s: the same when ringrun itself was asked to stop (SIGTERM from Slurm
            or Kubernetes, Ctrl-C): time for the ranks to save a checkpoint. Defaults to
            25.0, within Slurm's and Kubernetes' 30 s before they kill.
    """

    poll_interval_s: float = 0.1
    launcher_grace_s: float = 2.0
    terminate_grace_s: float = 3.0
    signal_grace_s: float = 25.0


@dataclass(frozen=True)
class StartWatch:
    """Ranks that must start their program within a time limit, or the job is stopped.

    Args:
        timeout_s: seconds from starting the launcher until every rank in ``ranks`` must
            have reported that its wrapper started the program (before the program's own
            imports: slow imports do not count).
        ranks: the ranks to watch, normally all of them.
    """

    timeout_s: float
    ranks: frozenset[int]


@dataclass
class JobResult:
    """How a job ended.

    Args:
        exit_code: what ringrun should exit with.
        first_failure: the first rank failure reported, or ``None``.
        failures: every failure reported, in the order the reports arrived.
        launcher_returncode: the launcher's own exit status (negative: killed by a signal).
        stopped_by: the signal that made ringrun stop the job, or ``None``.
        not_started: ranks that had not started their program when the start timeout
            ended, so ringrun stopped the job; empty otherwise.
        started: the start report of every rank that sent one, by rank.
        host_problems: what ssh said about hosts it could not start ranks on, as the
            launcher passed it on.
        start_errors: lines of the launcher's output that explain a failed start without
            naming a host ("No such file or directory" from a remote shell).
        faults: what ringplug said on the ranks it ended, in the order the reports arrived.
        finished: the ranks whose program exited with code 0, in that order.
        root: the rank that most likely caused the failure, and the evidence.
        unreported: ranks that started but never reported how they ended (killed together
            with their wrapper).
        hints: what to do about errors the ranks printed (`ringplug.run.launch.hints`).
    """

    exit_code: int
    first_failure: RankStatus | None = None
    failures: list[RankStatus] = field(default_factory=list)
    launcher_returncode: int | None = None
    stopped_by: int | None = None
    not_started: list[int] = field(default_factory=list)
    started: dict[int, RankStarted] = field(default_factory=dict)
    host_problems: list[HostProblem] = field(default_factory=list)
    start_errors: list[str] = field(default_factory=list)
    faults: list[RankFault] = field(default_factory=list)
    finished: list[RankStatus] = field(default_factory=list)
    root: RootCause | None = None
    unreported: list[int] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RootCause:
    """The rank whose failure most likely caused the others, and what shows it.

    Args:
        rank: the rank.
        status: how its program ended, when it ended before the others gave up on it
            (``None``: it was stopped by the teardown, or never reported).
        fault: what ringplug said on the first rank it ended because of this one (or on
            this rank itself), or ``None``.
        named_by: the ranks whose fault reports name it.
        left_early: it exited with code 0 while the others still needed it.
    """

    rank: int | None
    status: RankStatus | None
    fault: RankFault | None = None
    named_by: tuple[int, ...] = ()
    left_early: bool = False

    @property
    def exit_code(self) -> int:
        """The job's exit code: the rank's own code (``sys.exit(n)`` gives n), else 1."""
        if self.status is not None and not self.status.clean:
            return self.status.shell_exit_code
        return 1


def find_root_cause(
    failures: list[RankStatus],
    arrivals: list[float],
    faults: list[RankFault],
    finished: list[RankStatus],
) -> RootCause | None:
    """The root cause among the reports of a job that failed.

    A rank that other ranks name (it stopped answering, failed a collective or left the
    job) comes first, whatever order the reports arrived in; then a rank that ringplug
    ended for a cause of its own (an uncaught exception); then the rank that ended first
    (`root_cause`).
    """
    reports = {status.rank: status for status in [*finished, *failures] if status.rank is not None}
    blaming = [fault for fault in faults if fault.culprits]
    if blaming:
        first = min(blaming, key=lambda fault: fault.timestamp)
        votes = collections.Counter(rank for fault in blaming for rank in fault.culprits)
        rank = max(first.culprits, key=lambda r: (votes[r], -r))
        status = reports.get(rank)
        if status is not None and status.signal_name and status.timestamp > first.timestamp:
            status = None  # killed in the teardown: not how it failed
        named_by = tuple(sorted({fault.rank for fault in blaming if rank in fault.culprits}))
        left = status is not None and status.clean
        return RootCause(rank, status, first, named_by, left_early=left)
    own = [fault for fault in faults if not fault.culprits]
    if own:
        first = min(own, key=lambda fault: fault.timestamp)
        # A rank killed from outside (SIGKILL, SIGSEGV) about when the fault happened is
        # its cause: the fault is how a peer noticed, in an error that names nobody (a
        # library's "connection reset"), however late the dead rank's report arrived.
        killed = [
            status
            for status in failures
            if status.signal_name is not None
            and status.signal_name not in TEARDOWN_SIGNALS
            and status.timestamp <= first.timestamp + _SIMULTANEOUS_S
        ]
        if killed:
            dead = min(killed, key=lambda status: status.timestamp)
            return RootCause(dead.rank, dead)
        return RootCause(first.rank, reports.get(first.rank), first)
    status = root_cause(failures, arrivals)
    if status is not None:
        return RootCause(status.rank, status)
    return None


def run_job(
    plan: LaunchPlan,
    environ: Mapping[str, str] | None = None,
    teardown: Teardown | None = None,
    events_token: str | None = None,
    start_watch: StartWatch | None = None,
    terminal: TerminalSpec | None = None,
) -> JobResult:
    """Run ``plan`` to completion and return how it ended.

    Args:
        plan: what to start.
        environ: base environment for the launcher. Defaults to ``os.environ``.
        teardown: timing of failure handling. Defaults to ``Teardown()``.
        events_token: the token the ranks' wrappers mark their event lines with (the
            value of ``RINGPLUG_RUN_EVENTS`` they were given), or ``None`` when they
            report nothing.
        start_watch: ranks that must start in time. Defaults to ``None`` (no limit); it
            needs ``events_token``.
        terminal: ringrun's streams that are a terminal, as the ranks were told in
            ``RINGPLUG_RUN_TERMINAL``: rank 0's output events go there as raw bytes, above
            which the other ranks' lines are written. Defaults to ``None`` (lines only).
    """
    environ = os.environ if environ is None else environ
    env = {**environ, **plan.launcher_env}
    watcher = _JobWatcher(plan, env, teardown or Teardown(), events_token, start_watch)
    watcher.terminal = terminal if events_token is not None else None
    return watcher.run()


def _fileno(stream: object, default: int) -> int:
    """The descriptor behind ``stream``, or ``default`` when it has none (a test's capture)."""
    try:
        return stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return default


class _Relay(threading.Thread):
    """Copies one of the launcher's output streams to one of ringrun's, taking events out.

    Whole lines go out at once (the launcher already tagged them with their rank); a line
    without its end (a prompt, a progress bar) waits briefly for it (`pump_lines`). With a
    terminal sink, rank 0's output events go to it as raw bytes and lines above them.
    """

    def __init__(
        self,
        source: BinaryIO,
        sink_fd: int,
        token: str | None,
        on_event: Callable[[Event], None],
        on_line: Callable[[str], None] | None = None,
        terminal: TerminalSink | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.source = source
        self.sink_fd = sink_fd
        self.token = token
        self.on_event = on_event
        self.on_line = on_line
        self.terminal = terminal
        self.on_output = on_output  # every line or terminal chunk a rank wrote

    def run(self) -> None:
        pump_lines(self.source, self._line)

    def _line(self, line: bytes) -> None:
        text = line.decode(errors="replace")
        if self.token is not None and wire.EVENT_MARK in text:
            event = parse_event(text, self.token)
            if isinstance(event, RankOutput):
                self._write_raw(event.data)
                if self.on_output is not None:
                    self.on_output(event.data.decode(errors="replace"))
                return
            if event is not None:
                self.on_event(event)
                return
        if self.on_line is not None:
            self.on_line(text)
        if self.on_output is not None:
            self.on_output(text)
        if self.terminal is not None:
            self.terminal.line(line)
        else:
            self._write(line)

    def _write_raw(self, data: bytes) -> None:
        if self.terminal is not None:
            self.terminal.raw(data)
        else:
            self._write(data)

    def _write(self, line: bytes) -> None:
        # When ringrun's own output went away, the launcher's is still drained.
        write_all(self.sink_fd, line)


# Reports that arrive this close together may come in either order: a rank that crashes
# because its peer on another host was killed can be reported first.
_SIMULTANEOUS_S = 2.0

# Signals a rank dies of when the job is being stopped (ringrun's and the launchers'
# teardowns, a closed terminal or pipe); any other signal came from outside the job.
TEARDOWN_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP", "SIGPIPE"})


def root_cause(failures: list[RankStatus], arrivals: list[float]) -> RankStatus | None:
    """The failure that most likely caused the others.

    Among the reports that arrived within `_SIMULTANEOUS_S` of the first one, the rank
    that ended first by its host's clock (hosts' clocks agree to well under that); a later
    report is a consequence of the teardown, whatever its clock says.
    """
    if not failures:
        return None
    near = [
        f for f, t in zip(failures, arrivals, strict=True) if t - arrivals[0] <= _SIMULTANEOUS_S
    ]
    return min(near, key=lambda failure: failure.timestamp)


class _JobWatcher:
    """One launcher process, the rank events from its output, and the teardown state machine."""

    def __init__(
        self,
        plan: LaunchPlan,
        env: dict[str, str],
        teardown: Teardown,
        events_token: str | None,
        start_watch: StartWatch | None = None,
    ) -> None:
        self.plan = plan
        self.env = env
        self.teardown = teardown
        self.events_token = events_token
        self.start_watch = start_watch if events_token is not None else None
        self.process: subprocess.Popen[bytes] | None = None
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.terminal: TerminalSpec | None = None
        self.diagnosis = LaunchDiagnosis()
        self.hints: list[str] = []  # what to do about errors the ranks printed (`hints`)
        self.diagnosis_lock = threading.Lock()
        self.failures: list[RankStatus] = []
        self.failure_arrivals: list[float] = []  # monotonic time each report arrived
        self.started: dict[int, RankStarted] = {}
        self.faults: list[RankFault] = []
        self.finished: list[RankStatus] = []
        self.stop_signal: int | None = None
        # When the start reports are due (monotonic clock); None once checked or unwatched.
        self.start_deadline: float | None = None
        self.not_started: list[int] = []
        # Set once a teardown starts: when, and whether SIGTERM/SIGKILL went out yet.
        self.teardown_started: float | None = None
        self.terminated_at: float | None = None
        self.killed = False
        # Stack reports (stalls, SIGUSR1, ringrun --stacks) and the job's flight records.
        self.desk = StackDesk(self._ask_ranks, self._running_ranks, self._rank_hosts)
        self.flight: FlightFile | None = None

    def run(self) -> JobResult:
        """Start the launcher and supervise it until it exits."""
        handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        if self.events_token is not None:  # wrappers answer for their ranks' stacks
            handlers[signal.SIGUSR1] = signal.signal(
                signal.SIGUSR1, lambda signum, frame: self.desk.on_signal()
            )
            self.desk.listen()
        relays: list[_Relay] = []
        try:
            self.process = subprocess.Popen(
                self.plan.argv,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Its own session: ringrun can signal the launcher and its helpers as a group,
                # and a Ctrl-C in the terminal reaches ringrun alone, which decides.
                start_new_session=True,
                # If ringrun itself is SIGKILLed, the launcher still hears about it and
                # stops the ranks.
                preexec_fn=parent_death_signal(signal.SIGTERM),
            )
            assert self.process.stdout is not None and self.process.stderr is not None
            token, put = self.events_token, self.events.put
            fds = {"stdout": _fileno(sys.stdout, 1), "stderr": _fileno(sys.stderr, 2)}
            sinks = terminal_sinks(fds, self.terminal) if self.terminal is not None else {}
            relays = [
                _Relay(self.process.stdout, fds["stdout"], token, put, None,
                       sinks.get("stdout"), self._hint),
                _Relay(self.process.stderr, fds["stderr"], token, put, self._diagnose,
                       sinks.get("stderr"), self._hint),
            ]  # fmt: skip
            for relay in relays:
                relay.start()
            if self.start_watch is not None and self.start_watch.ranks:
                self.start_deadline = time.monotonic() + self.start_watch.timeout_s
            returncode = self._supervise()
        finally:
            if self.process is not None:
                self._signal_group(signal.SIGKILL)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            self.desk.close()
        drain_until = time.monotonic() + _DRAIN_TIMEOUT_S
        for relay in relays:
            relay.join(max(0.0, drain_until - time.monotonic()))
            if relay.terminal is not None:
                relay.terminal.finish()
        self._take_events()
        return self._result(returncode)

    def _diagnose(self, line: str) -> None:
        with self.diagnosis_lock:
            self.diagnosis.feed(line)

    def _hint(self, text: str) -> None:
        hint = hint_for(text)
        if hint is not None and hint not in self.hints:
            self.hints.append(hint)  # one list.append: safe from both relays' threads

    def _take_events(self) -> None:
        """Move the events that arrived into the failure list and the start reports."""
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, RankStarted):
                if event.rank is not None:
                    self.started.setdefault(event.rank, event)
            elif isinstance(event, RankFault):
                if event not in self.faults:  # the wrapper relays what the rank also printed
                    self.faults.append(event)
            elif isinstance(event, RankStacks):
                self.desk.on_stacks(event.rank, event.host, event.reason, event.report)
            elif isinstance(event, RankFlight):
                self.flight = self.flight or FlightFile()
                self.flight.add(event.rank, event.record)
            elif event.clean:
                self.finished.append(event)
            else:
                self.failures.append(event)
                self.failure_arrivals.append(time.monotonic())

    def _supervise(self) -> int:
        """Wait for the launcher, escalating the teardown once a rank failed or on a signal."""
        assert self.process is not None
        while True:
            try:
                return self.process.wait(timeout=self.teardown.poll_interval_s)
            except subprocess.TimeoutExpired:
                pass
            self._take_events()
            now = time.monotonic()
            self.desk.poll(now)
            if self.teardown_started is None:
                if self.stop_signal is not None:
                    # The user asked to stop: no grace for the launcher, terminate now.
                    self.teardown_started = now - self.teardown.launcher_grace_s
                elif self.failures:
                    logger.info("a rank failed; stopping the job")
                    self.teardown_started = now
                elif self._start_overdue(now):
                    logger.info("ranks %s did not start in time; stopping", self.not_started)
                    # The launcher sees nothing wrong and would not end the job: no grace.
                    self.teardown_started = now - self.teardown.launcher_grace_s
            if self.teardown_started is not None:
                self._escalate(now)

    def _ask_ranks(self) -> None:
        """Ask every rank's wrapper for its stacks: the launcher passes SIGUSR1 on to each
        (hydra and Open MPI forward it to every process they started, on every host)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.send_signal(signal.SIGUSR1)

    def _running_ranks(self) -> set[int]:
        ended = {s.rank for s in self.failures + self.finished}
        return set(self.started) - ended

    def _rank_hosts(self) -> dict[int, str]:
        return {rank: event.host for rank, event in self.started.items()}

    def _start_overdue(self, now: float) -> bool:
        """At the start deadline, note which watched ranks never started; True if any."""
        if self.start_deadline is None or now < self.start_deadline:
            return False
        assert self.start_watch is not None
        self.start_deadline = None  # checked once: a rank, once started, stays started
        self.not_started = sorted(self.start_watch.ranks - set(self.started))
        return bool(self.not_started)

    def _escalate(self, now: float) -> None:
        """Send SIGTERM, then SIGKILL, to the launcher's group once each grace period ends."""
        assert self.teardown_started is not None
        if self.terminated_at is None:
            if now - self.teardown_started >= self.teardown.launcher_grace_s:
                logger.info("sending SIGTERM to the launcher's process group")
                self._signal_group(signal.SIGTERM)
                self.terminated_at = now
        elif not self.killed and now - self.terminated_at >= (
            self.teardown.terminate_grace_s
            if self.stop_signal is None
            else self.teardown.signal_grace_s
        ):
            logger.info("sending SIGKILL to the launcher's process group")
            self._signal_group(signal.SIGKILL)
            self.killed = True

    def _signal_group(self, sig: int) -> None:
        """Signal the launcher's process group, which its session started."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Ctrl-C or SIGTERM to ringrun: stop the job; a second one kills it at once."""
        if self.stop_signal is not None and self.process is not None:
            self._signal_group(signal.SIGKILL)
            self.killed = True
        self.stop_signal = signum

    def _result(self, returncode: int) -> JobResult:
        """Decide the exit code from the signal, the rank reports and the launcher's status."""
        first = root_cause(self.failures, self.failure_arrivals)
        root = find_root_cause(self.failures, self.failure_arrivals, self.faults, self.finished)
        with self.diagnosis_lock:
            host_problems = list(self.diagnosis.problems)
            start_errors = list(self.diagnosis.unnamed)
        # Every started rank reports how it ended; one that did not was killed with its
        # wrapper (hydra does that to the whole job when a rank leaves without MPI_Finalize,
        # and may then exit 0).
        ended = {status.rank for status in [*self.failures, *self.finished]}
        unreported = sorted(rank for rank in self.started if rank not in ended)
        killed_quietly = bool(unreported) and returncode == 0 and self.stop_signal is None
        failed = returncode != 0 or killed_quietly
        everyone_started = not start_errors and (
            self.start_watch is None or self.start_watch.ranks <= set(self.started)
        )
        if root is None and failed and self.finished and not host_problems and everyone_started:
            # Nothing failed, yet the launcher did: a rank that left first, with code 0 and
            # without ringplug ending cleanly (os._exit), made it stop the others.
            early = min(self.finished, key=lambda status: status.timestamp)
            root = RootCause(early.rank, early, left_early=True)
        if self.stop_signal is not None:
            exit_code = 128 + self.stop_signal
        elif self.not_started:
            # Ranks that did start were stopped on purpose; their reports are not the cause.
            exit_code = START_TIMEOUT_EXIT_CODE
        elif root is not None and (root.fault is not None or not root.left_early):
            exit_code = root.exit_code
        elif first is not None:
            exit_code = first.shell_exit_code
        elif host_problems and returncode != 0:
            exit_code = START_FAILED_EXIT_CODE
        elif returncode < 0:
            exit_code = 128 - returncode
        else:
            exit_code = returncode
        if exit_code == 0 and killed_quietly:
            exit_code = 1
        return JobResult(
            exit_code=exit_code,
            first_failure=first,
            failures=list(self.failures),
            launcher_returncode=returncode,
            stopped_by=self.stop_signal,
            not_started=self.not_started,
            started=dict(self.started),
            host_problems=host_problems,
            start_errors=start_errors,
            faults=list(self.faults),
            finished=list(self.finished),
            root=root,
            unreported=unreported,
            hints=list(self.hints),
        )
