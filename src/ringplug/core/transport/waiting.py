"""Waiting with a deadline: every MPI operation of the engine completes, or the job ends
naming the rank that stopped taking part.

MPI cannot cancel a collective, and its blocking calls have no timeout. So the engine posts
the nonblocking forms (`Isend`/`Irecv`, `Iallreduce`, `Ibcast`, ...) and waits for them
here: test, yield, then sleep a growing interval (at most 1 ms once the wait is long, so a
rank waiting for a frozen peer measured 2-3% of a core on the 2-core CI machine).

A wait that lasts `RINGPLUG_STALL_CHECK_SECONDS` or `RINGPLUG_TIMEOUT` cannot tell by
itself who is at fault: in a ring, a rank frozen in one place leaves every other rank stuck
in another. So the waiting rank sends every peer a *notice* ("rank r is alive and waiting
in X") on the engine's control communicator and listens a short while for theirs. The
peers that say nothing are the ones that stopped taking part: stopped (SIGSTOP), stuck in
C code that holds the GIL, swapping, or dead. At the stall check this is a warning; at the
timeout the rank ends the job with a message naming them and the collective.

A rank that fails a collective on its own (an exception while running it) sends a *failure*
notice instead, so that its peers stop waiting for it and fail the same collective with its
text rather than hang. A rank whose engine ends for good (an error outside any one
collective) sends a *final* notice: every later wait of its peers fails with its text, at
once, instead of lasting until the timeout and naming it as frozen.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ...config import Settings
from .. import log
from ..errors import PeerEngineFailedError, PeerFailedError
from .traffic import NOTICES, Traffic

if TYPE_CHECKING:
    from mpi4py import MPI

logger = logging.getLogger(__name__)

NOTICE_TAG = 7300

# Right after posting, most operations finish within microseconds: test in a tight loop
# first (yielding the core there slows small allreduces on a loaded machine), then yield
# between tests (spinning longer starves ranks that share cores). Then sleep, doubling from
# 20 us to 200 us while the wait is young (a late message costs little) and to 1 ms once it
# has lasted 50 ms (figures: docs/benchmarks.md, "Design measurements").
_TIGHT_SECONDS = 50e-6
_SPIN_SECONDS = 200e-6
# With a core per rank, nothing is starved by yielding: test (and so progress MPI's
# nonblocking collectives, which advance only inside a test) for 10 ms before sleeping.
# A sleep between tests lasts far longer than asked and stalls MPI's progress
# (figures: docs/benchmarks.md, "Design measurements").
SPIN_SECONDS_WITH_A_CORE_EACH = 10e-3
_FIRST_SLEEP_SECONDS = 20e-6
_BUSY_SLEEP_SECONDS = 200e-6
IDLE_SLEEP_SECONDS = 1e-3
_IDLE_AFTER_SECONDS = 50e-3


def _sleep_zero() -> None:
    time.sleep(0)  # releases the GIL and the core


def next_delay(delay: float, quiet_since: float, now: float | None = None) -> float:
    """The next sleep between polls: doubled, at most 200 us while the wait (or the quiet
    spell since `quiet_since`, a `time.perf_counter()` time) is young, 1 ms after 50 ms."""
    now = time.perf_counter() if now is None else now
    idle = now - quiet_since >= _IDLE_AFTER_SECONDS
    return min(delay * 2, IDLE_SLEEP_SECONDS if idle else _BUSY_SLEEP_SECONDS)


# Notices are looked for this often during a long wait (an Iprobe costs about a microsecond).
_NOTICE_PERIOD_SECONDS = 10e-3
# A final notice is sent before the process may exit: MPI takes a small message at once
# (eager), so this bound is only reached when the peers' side is gone. Its text is cut to
# stay well below every eager limit.
_FLUSH_SECONDS = 1.0
_TEXT_CHARS = 4000


def listen_window(settings: Settings) -> float:
    """Seconds before a verdict that a stuck rank sends its notices and starts listening for
    its peers' ones.

    Peers stuck in the same collective reach that point within a fraction of a second of
    each other (they entered it together), and a notice takes microseconds.
    """
    return min(3.0, max(1.0, settings.timeout / 4))


@dataclasses.dataclass
class Notice:
    """What one rank tells the others while it waits too long, or after it failed.

    Args:
        rank: the sender.
        cycle: its engine cycle (collectives of one cycle run in the same order everywhere).
        index: the position of the collective in that cycle's plan (-1: negotiation).
        what: the collective, e.g. ``allreduce 'grad'``.
        text: for a failure, the error ("MemoryError: ..."); empty for a waiting notice.
        final: the sender's engine has ended for good: it takes part in nothing any more.
        answer: the sender is alive and idle, answering a peer's waiting notice (see
            `Waiter.answer_waiting_peers`).
        named: the sender as errors name it: its rank in the world (a process set's engine
            numbers its members from 0); -1 until sent.
    """

    rank: int
    cycle: int
    index: int
    what: str
    text: str = ""
    final: bool = False
    answer: bool = False
    named: int = -1

    @property
    def failed(self) -> bool:
        return bool(self.text)

    @property
    def shown(self) -> int:
        """The sender's rank as messages name it (the world's)."""
        return self.named if self.named >= 0 else self.rank


class Waiter:
    """Waits of one engine (its thread only), with the stall check, the deadline and notices.

    Args:
        comm: the communicator notices travel on (the engine's control communicator), or
            ``None`` for a world of one.
        settings: the timeouts.
        rank, size: this rank and the job's size (a process set's: its own numbering).
        ranks: for a process set, the world's rank of each member, by which messages and
            culprits name them.
    """

    def __init__(
        self,
        comm: MPI.Comm | None,
        settings: Settings,
        rank: int,
        size: int,
        ranks: tuple[int, ...] | None = None,
    ) -> None:
        self._comm = comm
        self.settings = settings
        self.rank, self.size = rank, size
        self._world = ranks if ranks is not None else tuple(range(size))
        self.world_rank = self._world[rank]
        self.cycle = 0
        self.index = -1
        self.what = "negotiation"
        self._heard: dict[int, Notice] = {}  # rank -> its latest waiting notice
        self._asked: set[int] = set()  # ranks whose waiting notice no answer has gone to
        self._failures: list[Notice] = []  # failure notices of this cycle and later
        self._sends: list[Any] = []  # notice sends still in flight
        self._payloads: list[bytearray] = []
        # How long a wait tests and yields before it sleeps, and how it yields meanwhile (see
        # `spin_with_a_core_each`).
        self.spin_seconds = _SPIN_SECONDS
        self.pause: Callable[[], None] = _sleep_zero  # one yield of the core between tests
        self.abandoned: list[Any] = []  # requests of collectives given up (see wait_requests)
        # What this engine sends (its exchange, ring and transport count there too).
        self.traffic = Traffic()
        if comm is not None:  # looked up once: every collective reads the notices
            from mpi4py import MPI

            self._status, self._any_source, self._byte = MPI.Status(), MPI.ANY_SOURCE, MPI.BYTE

    # ------------------------------------------------------------------ context
    def begin(self, cycle: int, index: int, what: str) -> None:
        """Say which collective the next waits belong to (position `index` of `cycle`)."""
        if cycle != self.cycle and self._failures:
            self._failures = [n for n in self._failures if n.final or n.cycle >= cycle]
        self.cycle, self.index, self.what = cycle, index, what

    def peer_failure(self) -> Notice | None:
        """A peer's failure that ends the current collective: one at or before its position
        in this cycle (later ones are kept for the collectives they concern)."""
        self._read_notices()
        for notice in self._failures:
            if notice.final or (notice.cycle == self.cycle and notice.index <= self.index):
                return notice
        return None

    def announce_failure(self, text: str) -> None:
        """Tell every peer that this rank failed the current collective, and why."""
        self._send(Notice(self.rank, self.cycle, self.index, self.what, text))

    def announce_end(self, text: str, within: float = _FLUSH_SECONDS) -> None:
        """Tell every peer that this rank's engine has ended for good, and why, and wait (at
        most `within` seconds) until MPI has taken the notices: the process may exit next."""
        self._send(Notice(self.rank, self.cycle, self.index, self.what, text[:_TEXT_CHARS], True))
        deadline = time.monotonic() + within
        delay = _FIRST_SLEEP_SECONDS
        while True:
            self._reap_sends()
            if not self._sends:
                return
            if time.monotonic() >= deadline:
                logger.warning(
                    "rank %d could not hand its final notice to MPI within %g s (%d of its "
                    "sends to the other %d ranks still posted); a rank that misses it ends at "
                    "RINGPLUG_TIMEOUT, naming this one as frozen",
                    self.rank,
                    within,
                    len(self._sends),
                    self.size - 1,
                )
                return
            time.sleep(delay)
            delay = min(delay * 2, _BUSY_SLEEP_SECONDS)

    def spin_with_a_core_each(self) -> None:
        """Every local rank has a core: spin longer, yielding with sched_yield (MPI's test
        releases the GIL, so the training thread still runs). ``time.sleep(0)`` sleeps
        for the timer slack (about 60 us here), which made each yield cost a small
        allreduce as much as MPI's whole collective."""
        self.spin_seconds = SPIN_SECONDS_WITH_A_CORE_EACH
        self.pause = os.sched_yield if hasattr(os, "sched_yield") else _sleep_zero

    def spin_like(self, other: Waiter) -> None:
        """Test and yield as `other` does (an engine's waiter, which knows whether every
        local rank has a core): a transport of its own, as `ringplug-bench algorithms`
        makes, must time its algorithms as the engine's transport runs them."""
        self.spin_seconds, self.pause = other.spin_seconds, other.pause

    # ------------------------------------------------------------------ waiting
    def wait_requests(self, requests: Sequence[Any], phase: str = "") -> None:
        """Wait until every MPI request in `requests` completed (see `wait`)."""
        if not requests:
            return
        requests = list(requests)
        # One request (the usual case) is tested by its own method: the poll loop is MPI's
        # progress engine, and each Python call less in it is more progress per microsecond.
        if len(requests) == 1:
            done = requests[0].Test
        else:
            testall = type(requests[0]).Testall
            done = lambda: testall(requests)  # noqa: E731
        try:
            self.wait(done, phase)
        except BaseException:
            # Abandoned: MPI may still write into their buffers, which the requests keep
            # alive; so keep the requests.
            self.abandoned.extend(requests)
            raise

    def wait(
        self,
        done: Callable[[], bool],
        phase: str | Callable[[], str] = "",
        missing: Callable[[], list[int]] | None = None,
        give_up: Callable[[str, list[int]], None] | None = None,
    ) -> None:
        """Call `done` until it returns True, with a stall warning and a deadline.

        Args:
            done: tests for completion (and makes MPI progress).
            phase: where in the collective, for messages ("ring step 2 of 4"), or a function
                that says it (called only for a message).
            missing: the peers this wait is known to lack (negotiation knows them);
                ``None`` when only notices can tell.
            give_up: what to do at the deadline instead of ending the job (work that can
                be cancelled, as NCCL's can): called with the verdict and the ranks at
                fault; it must raise.

        Raises:
            PeerFailedError: a peer failed this collective and said so.
        """
        if done():
            return
        start = time.perf_counter()
        tight_until, spin_until = start + _TIGHT_SECONDS, start + self.spin_seconds
        # Most waits end within the spin: test with nothing else in the loop (a ring step
        # waits hundreds of times per collective); notices and deadlines are set up after.
        while True:
            if done() or done() or done() or done():  # the clock only every few tests
                return
            now = time.perf_counter()
            if now >= spin_until:
                break
            if now >= tight_until:
                self.pause()
        settings = self.settings
        look_at = start + _NOTICE_PERIOD_SECONDS
        check, limit = settings.stall_check_seconds, self._limit()
        # Notices go out a listening window before each verdict, so that the warning comes
        # at RINGPLUG_STALL_CHECK_SECONDS and the end at RINGPLUG_TIMEOUT, not later; at
        # most half-way into the wait (short test timeouts).
        warn_at, end_at = start + check, start + limit
        window = listen_window(settings)
        notice_times = sorted(
            {start + check - min(window, check / 2), start + limit - min(window, limit / 2)}
        )
        delay = _FIRST_SLEEP_SECONDS
        while not done():
            now = time.perf_counter()
            if now >= look_at:
                look_at = now + _NOTICE_PERIOD_SECONDS
                failure = self.peer_failure()
                if failure is not None:
                    raise peer_failed_error(failure, self.what)
                self._reap_sends()
                if notice_times and now >= notice_times[0]:
                    del notice_times[0]
                    self._send(Notice(self.rank, self.cycle, self.index, self.what))
                if now >= warn_at:
                    warn_at = math.inf
                    self._warn(now - start, phase, missing)
                if now >= end_at:
                    self._end_job(now - start, limit, phase, missing, give_up)
            time.sleep(delay)
            delay = next_delay(delay, start, now)

    # ------------------------------------------------------------------ verdicts
    def _silent(self, missing: Callable[[], list[int]] | None) -> tuple[list[int], list[int]]:
        """(peers that sent nothing lately, peers that said they are waiting too)."""
        self._read_notices()
        alive = sorted(
            r for r, n in self._heard.items() if n.cycle >= self.cycle - 1 and r != self.rank
        )
        lacking = set(missing()) if missing is not None else None
        silent = [
            r
            for r in range(self.size)
            if r != self.rank and r not in alive and (lacking is None or r in lacking)
        ]
        return silent, alive

    def _where(self, waited: float, phase: str | Callable[[], str]) -> str:
        if callable(phase):
            phase = phase()
        where = f"{self.what}" + (f" ({phase})" if phase else "")
        return (
            f"rank {self.world_rank} has waited {waited:.0f} s in {where}, engine cycle "
            f"{self.cycle}"
        )

    def _who(self, ranks: Sequence[int]) -> str:
        """`_who` of the world's ranks of `ranks` (this engine's numbering)."""
        return _who([self._world[r] for r in ranks])

    def _warn(
        self, waited: float, phase: str | Callable[[], str], missing: Callable[[], list[int]] | None
    ) -> None:
        silent, alive = self._silent(missing)
        # One rank speaks for all: the lowest one that is itself still taking part, and
        # waiting (an idle rank's answer says it is alive, but it warns of nothing).
        if min([self.rank, *(r for r in alive if not self._heard[r].answer)]) != self.rank:
            return
        if silent:
            verdict = (
                f"{self._who(silent)} stopped taking part: {_they(silent)} sent no notice of "
                "waiting (frozen: stopped, stuck in C code holding the GIL, swapping, or dead)"
            )
        else:
            verdict = "every rank is still taking part (a slow peer, or one still computing)"
        limit = self._limit()
        logger.log(
            logging.WARNING if self.world_rank == 0 else logging.ERROR,
            "Stall: %s; %s. The job ends after %g s of waiting (RINGPLUG_STALL_CHECK_SECONDS="
            "%g, %s=%g).",
            self._where(waited, phase),
            verdict,
            limit,
            self.settings.stall_check_seconds,
            self._limit_name(),
            limit,
        )

    def _limit(self) -> float:
        """Seconds a wait may last: the timeout, or the stall shutdown time if sooner."""
        settings = self.settings
        if 0 < settings.stall_shutdown_seconds < settings.timeout:
            return settings.stall_shutdown_seconds
        return settings.timeout

    def _limit_name(self) -> str:
        if self._limit() == self.settings.timeout:
            return "RINGPLUG_TIMEOUT"
        return "RINGPLUG_STALL_SHUTDOWN_SECONDS"

    def _end_job(
        self,
        waited: float,
        limit: float,
        phase: str | Callable[[], str],
        missing: Callable[[], list[int]] | None,
        give_up: Callable[[str, list[int]], None] | None = None,
    ) -> None:
        silent, alive = self._silent(missing)
        if self.size == 1:
            verdict = "this rank is the whole job, and its own work did not finish"
        elif silent:
            plural = len(silent) > 1
            verdict = (
                f"{self._who(silent)} stopped answering: {_they(silent)} neither did "
                f"{'their' if plural else 'its'} part nor said {_they(silent)} "
                f"{'were' if plural else 'was'} waiting (frozen: stopped, stuck in C code "
                "holding the GIL, swapping, or dead)"
            )
        else:
            lacking = missing() if missing is not None else []
            verdict = "every other rank says it is waiting too" + (
                f" ({self._who(lacking)} did not answer this cycle)" if lacking else ""
            )
        others = [r for r in alive if r not in silent]
        waiting = [r for r in others if not self._heard[r].answer]
        idle = [r for r in others if self._heard[r].answer]
        also = ""
        if silent and waiting:
            also += f"; {self._who(waiting)} {'are' if len(waiting) > 1 else 'is'} waiting too"
        if silent and idle:
            also += (
                f"; {self._who(idle)} {'are' if len(idle) > 1 else 'is'} alive with nothing to "
                "run (this cycle's messages reach "
                f"{'them' if len(idle) > 1 else 'it'} through the ranks that stopped)"
            )
        verdict = f"{self._where(waited, phase)}: {verdict}{also} ({self._limit_name()}={limit:g})."
        culprits = silent or (missing() if missing is not None else [])
        if give_up is not None:
            give_up(verdict, culprits)
        log.end_job(
            self.world_rank,
            f"{verdict} Ending the job: MPI cannot cancel a collective.",
            [self._world[r] for r in culprits],
        )

    # ------------------------------------------------------------------ notices
    def _send(self, notice: Notice, to: Sequence[int] | None = None) -> None:
        if self._comm is None or self.size == 1:
            return
        from mpi4py import MPI

        notice.named = self.world_rank
        payload = bytearray(pickle.dumps(notice, protocol=pickle.HIGHEST_PROTOCOL))
        self._payloads.append(payload)  # alive until its sends complete
        peers = [peer for peer in range(self.size) if peer != self.rank] if to is None else to
        for peer in peers:
            self._sends.append(self._comm.Isend([payload, MPI.BYTE], peer, NOTICE_TAG))
        self.traffic.sent(NOTICES, len(payload) * len(peers), len(peers))

    def _reap_sends(self) -> None:
        if self._sends:
            self._sends = [request for request in self._sends if not request.Test()]
            if not self._sends:
                self._payloads.clear()

    def _read_notices(self) -> None:
        comm = self._comm
        if comm is None:
            return
        status = self._status
        while comm.Iprobe(source=self._any_source, tag=NOTICE_TAG, status=status):
            buffer = bytearray(status.Get_count(self._byte))
            comm.Recv([buffer, self._byte], status.Get_source(), NOTICE_TAG)
            notice: Notice = pickle.loads(buffer)
            if notice.failed:
                if notice.final or notice.cycle >= self.cycle:
                    self._failures.append(notice)
            else:
                self._heard[notice.rank] = notice
                if not notice.answer:
                    self._asked.add(notice.rank)

    def answer_waiting_peers(self) -> None:
        """On a rank whose engine is idle: tell the peers that said they wait long that this
        rank is alive. A negotiation passes messages on through other ranks (see
        `Exchange`): behind a frozen rank, a healthy one may never have heard of the cycle
        its peers wait in, and without an answer they would name it as frozen too."""
        if self._comm is None:
            return
        self._read_notices()
        if self._asked:
            asked, self._asked = sorted(self._asked), set()
            self._send(Notice(self.rank, self.cycle, -1, "nothing: idle", answer=True), asked)


def peer_failed_error(notice: Notice, current: str) -> PeerFailedError:
    """The error that a peer's failure `notice` ends this rank's `current` wait with."""
    if notice.final:
        return PeerEngineFailedError(
            f"{current} cannot complete: rank {notice.shown}'s ringplug engine failed for good "
            f"(in {notice.what}, engine cycle {notice.cycle}): {notice.text}. Every rank must "
            "take part in every collective, so this rank cannot go on either; the cause is in "
            f"rank {notice.shown}'s log.",
            caused_by=(notice.shown,),
        )
    if notice.what == current:
        text = f"rank {notice.shown} failed {notice.what}: {notice.text}"
    else:
        text = (
            f"{current} did not run: rank {notice.shown} failed {notice.what} earlier in the "
            f"same engine cycle ({notice.text})"
        )
    return PeerFailedError(text, caused_by=(notice.shown,))


def _who(ranks: Sequence[int]) -> str:
    """``[1]`` -> "rank 1", ``[1, 2]`` -> "ranks 1, 2"."""
    return ("ranks " if len(ranks) > 1 else "rank ") + (", ".join(map(str, ranks)) or "none")


def _they(ranks: Sequence[int]) -> str:
    return "they" if len(ranks) > 1 else "it"
