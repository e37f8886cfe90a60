"""Running a launch plan: start the MPI launcher, watch for failed ranks, tear the job down.

The launcher runs in its own session so ringrun can signal its whole process group. Ranks
report failures through status files (see :mod:`ringplug.run.status`); the first report
starts a teardown that is bounded in time: a grace period in which the launcher may end the
job itself, then SIGTERM to its process group, then SIGKILL. Ranks that outlive their
launcher die through the wrapper's parent-death signal.

With a :class:`StartWatch`, ranks that have not left a start marker when its timeout ends
stop the job the same way, without the launcher's grace period (the launcher does not know
anything is wrong).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import FrameType

from ringplug.run.mpi import LaunchPlan
from ringplug.run.status import (
    STATUS_DIR_VARIABLE,
    RankStatus,
    has_statuses,
    read_statuses,
    started_ranks,
)
from ringplug.run.wrapper import parent_death_signal

logger = logging.getLogger(__name__)

START_TIMEOUT_EXIT_CODE = 124
"""ringrun's exit code when ranks did not start in time (as ``timeout(1)`` uses it)."""


@dataclass(frozen=True)
class Teardown:
    """How patiently a failed job is stopped; the sum bounds the time to stop every rank.

    Args:
        poll_interval_s: how often the status directory is checked. Defaults to 0.1.
        launcher_grace_s: time the launcher gets to end the job itself after the first
            failure (Open MPI does; hydra waits for the remaining ranks). Defaults to 2.0.
        terminate_grace_s: time between SIGTERM and SIGKILL to the launcher's process
            group. Defaults to 3.0.
    """

    poll_interval_s: float = 0.1
    launcher_grace_s: float = 2.0
    terminate_grace_s: float = 3.0


@dataclass(frozen=True)
class StartWatch:
    """Ranks that must start their program within a time limit, or the job is stopped.

    Args:
        timeout_s: seconds from starting the launcher until every rank in ``ranks`` must
            have started its program.
        ranks: the ranks to watch: those whose wrapper can write into the status
            directory, i.e. the ranks on ringrun's own machine.
    """

    timeout_s: float
    ranks: frozenset[int]


@dataclass
class JobResult:
    """How a job ended.

    Args:
        exit_code: what ringrun should exit with.
        first_failure: the earliest rank failure reported, or ``None``.
        failures: every failure reported, earliest first.
        launcher_returncode: the launcher's own exit status (negative: killed by a signal).
        stopped_by: the signal that made ringrun stop the job, or ``None``.
        not_started: ranks that had not started their program when the start timeout
            ended, so ringrun stopped the job; empty otherwise.
    """

    exit_code: int
    first_failure: RankStatus | None = None
    failures: list[RankStatus] = field(default_factory=list)
    launcher_returncode: int | None = None
    stopped_by: int | None = None
    not_started: list[int] = field(default_factory=list)


def run_job(
    plan: LaunchPlan,
    environ: Mapping[str, str] | None = None,
    teardown: Teardown | None = None,
    status_dir: str | None = None,
    start_watch: StartWatch | None = None,
) -> JobResult:
    """Run ``plan`` to completion and return how it ended.

    Args:
        plan: what to start.
        environ: base environment for the launcher. Defaults to ``os.environ``.
        teardown: timing of failure handling. Defaults to ``Teardown()``.
        status_dir: directory the ranks report failures into; it must be the one named by
            ``RINGPLUG_RUN_STATUS_DIR`` when the plan was built. Defaults to a fresh
            temporary directory that is removed afterwards.
        start_watch: ranks that must start in time. Defaults to ``None`` (no limit).
    """
    if status_dir is None:
        with tempfile.TemporaryDirectory(prefix="ringrun-status-") as directory:
            return run_job(plan, environ, teardown, directory, start_watch)
    environ = os.environ if environ is None else environ
    env = {**environ, **plan.launcher_env, STATUS_DIR_VARIABLE: status_dir}
    return _JobWatcher(plan, env, teardown or Teardown(), status_dir, start_watch).run()


class _JobWatcher:
    """One launcher process, its status directory and the teardown state machine."""

    def __init__(
        self,
        plan: LaunchPlan,
        env: dict[str, str],
        teardown: Teardown,
        status_dir: str,
        start_watch: StartWatch | None = None,
    ) -> None:
        self.plan = plan
        self.env = env
        self.teardown = teardown
        self.status_dir = status_dir
        self.start_watch = start_watch
        self.process: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None
        # When the start markers are due (monotonic clock); None once checked or unwatched.
        self.start_deadline: float | None = None
        self.not_started: list[int] = []
        # Set once a teardown starts: when, and whether SIGTERM/SIGKILL went out yet.
        self.teardown_started: float | None = None
        self.terminated_at: float | None = None
        self.killed = False

    def run(self) -> JobResult:
        """Start the launcher and supervise it until it exits."""
        handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self.process = subprocess.Popen(
                self.plan.argv,
                env=self.env,
                # Its own session: ringrun can signal the launcher and its helpers as a group,
                # and a Ctrl-C in the terminal reaches ringrun alone, which decides.
                start_new_session=True,
                # If ringrun itself is SIGKILLed, the launcher still hears about it and
                # stops the ranks.
                preexec_fn=parent_death_signal(signal.SIGTERM),
            )
            if self.start_watch is not None and self.start_watch.ranks:
                self.start_deadline = time.monotonic() + self.start_watch.timeout_s
            returncode = self._supervise()
        finally:
            if self.process is not None:
                self._signal_group(signal.SIGKILL)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return self._result(returncode)

    def _supervise(self) -> int:
        """Wait for the launcher, escalating the teardown once a rank failed or on a signal."""
        assert self.process is not None
        while True:
            try:
                return self.process.wait(timeout=self.teardown.poll_interval_s)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.teardown_started is None:
                if self.stop_signal is not None:
                    # The user asked to stop: no grace for the launcher, terminate now.
                    self.teardown_started = now - self.teardown.launcher_grace_s
                elif has_statuses(self.status_dir):
                    logger.info("a rank failed; stopping the job")
                    self.teardown_started = now
                elif self._start_overdue(now):
                    logger.info("ranks %s did not start in time; stopping", self.not_started)
                    # The launcher sees nothing wrong and would not end the job: no grace.
                    self.teardown_started = now - self.teardown.launcher_grace_s
            if self.teardown_started is not None:
                self._escalate(now)

    def _start_overdue(self, now: float) -> bool:
        """At the start deadline, note which watched ranks never started; True if any."""
        if self.start_deadline is None or now < self.start_deadline:
            return False
        assert self.start_watch is not None
        self.start_deadline = None  # checked once: a marker, once written, stays
        self.not_started = sorted(self.start_watch.ranks - started_ranks(self.status_dir))
        return bool(self.not_started)

    def _escalate(self, now: float) -> None:
        """Send SIGTERM, then SIGKILL, to the launcher's group once each grace period ends."""
        assert self.teardown_started is not None
        if self.terminated_at is None:
            if now - self.teardown_started >= self.teardown.launcher_grace_s:
                logger.info("sending SIGTERM to the launcher's process group")
                self._signal_group(signal.SIGTERM)
                self.terminated_at = now
        elif not self.killed and now - self.terminated_at >= self.teardown.terminate_grace_s:
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
        failures = read_statuses(self.status_dir)
        first = failures[0] if failures else None
        if self.stop_signal is not None:
            exit_code = 128 + self.stop_signal
        elif self.not_started:
            # Ranks that did start were stopped on purpose; their reports are not the cause.
            exit_code = START_TIMEOUT_EXIT_CODE
        elif first is not None:
            exit_code = first.shell_exit_code
        elif returncode < 0:
            exit_code = 128 - returncode
        else:
            exit_code = returncode
        return JobResult(
            exit_code=exit_code,
            first_failure=first,
            failures=failures,
            launcher_returncode=returncode,
            stopped_by=self.stop_signal,
            not_started=self.not_started,
        )
