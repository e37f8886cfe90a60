"""Who runs the next cycle: the engine's thread, or a caller waiting for its own collective.

The `Scheduler` is the one place that decides it. Whoever holds its `turn` runs cycles and
is the one thread of this engine talking to MPI at that moment:

- A caller about to wait for its own host collective (a synchronous call, see
  `kinds.base.waited_at_once`) runs the cycle itself, inside `submit`, when nothing is
  queued ahead of it, no join is in progress, no cycle time asks to gather more for fusion,
  and the turn is free (decided in `submit`): nothing is queued and no thread is woken.
- A caller that waits on a handle the engine has not completed takes the turn when it is
  free within a millisecond and nothing else is in flight, and runs cycles until its
  handle is done (`drive`).
- Otherwise the engine thread runs them (`run_engine_thread`), which is what lets
  asynchronous collectives overlap the caller's work; a caller that stops driving with
  work left hands over to it (`_after_driving`). GPU collectives keep to the engine
  thread (the CUDA device is per thread).

The scheduler also admits submissions (a name in flight once, none after a failure or
shutdown) and keeps the queue the next cycle takes (`take_submissions`). It knows nothing
of what a cycle does: it calls `run_cycle(fresh)` (`Cycle.run`).

Locks: `lock` (re-entrant) guards the queue, the in-flight names, the join handle and the
flags below; `turn` is held by the thread running cycles; the engine thread sleeps on
`bell`, which whoever gives it work releases (`ring`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ...wire import GPU
from ..errors import RingplugError
from ..transport.waiting import IDLE_SLEEP_SECONDS, next_delay
from .handles import Handle, Request

if TYPE_CHECKING:
    from ...config import Settings
    from ...forensics.flight import FlightRecorder
    from ..transport.waiting import Waiter
    from .counters import Counters
    from .exchange import Exchange

# After a cycle, the next submission or a peer's next message is usually well under a
# millisecond away; poll (yielding the GIL and the core) that long before sleeping.
_POLL_AFTER_CYCLE_SECONDS = 1e-3
# A burst of asynchronous submissions runs as one cycle: with at least `_BURST_LEAST`
# requests queued, the engine thread steps aside while the newest is younger than the gap,
# for at most the wait (`let_burst_finish`). Without it the engine thread takes the GIL at
# CPython's switch interval, in the middle of the loop, and a burst costs two negotiations
# (figures: docs/benchmarks.md, "Design measurements"). A few gradient buckets, or
# gradients that a backward pass hands over further apart than the gap, run at once.
_BURST_LEAST = 64
_BURST_GAP_SECONDS = 300e-6
BURST_WAIT_SECONDS = 1e-3
# A caller about to wait for its collective takes the cycles over from the engine thread
# when the turn is free within this long; otherwise the engine thread runs them.
_DRIVE_ACQUIRE_SECONDS = 1e-3
# While a caller drives, the engine thread sleeps until the caller hands over (it rings);
# this is only a backstop. Waking often to look slows a caller spinning in an Iallreduce:
# the woken thread takes the GIL from it (figures: docs/benchmarks.md, "Design measurements").
_DRIVEN_SLEEP_SECONDS = 0.05


class CycleState(Protocol):
    """What the scheduler reads of its engine's cycles (`cycle.Cycle` has it)."""

    number: int
    pending: dict[str, Request]
    joined_cycle: int


class Scheduled(Protocol):
    """What the scheduler needs of its engine (`engine.Engine` has it; no import of the
    engine here, which imports this module)."""

    settings: Settings
    rank: int
    size: int
    flight: FlightRecorder
    exchange: Exchange
    waiter: Waiter
    counters: Counters

    @property
    def cycle(self) -> CycleState: ...

    def thread_failed(self, exc: BaseException, turn: threading.Lock) -> None: ...


class Scheduler:
    """Admits one engine's submissions and decides which thread runs its next cycle.

    Args:
        engine: the engine whose cycles it schedules (read: `settings`, `size`, `rank`,
            `flight`, `exchange`, `waiter`, `counters`, `cycle`: see `Scheduled`).
        run_cycle: runs one cycle, of the queue (`None`) or of the given requests, by a
            waiting caller or not; True when the engine must stop (`Cycle.run`).
        thread_name: the engine thread's name.
    """

    def __init__(
        self,
        engine: Scheduled,
        run_cycle: Callable[[list[Request] | None, bool], bool],
        thread_name: str,
    ) -> None:
        self.engine = engine
        self.run_cycle = run_cycle
        self.lock = threading.RLock()
        self.turn = threading.Lock()  # held by the thread that runs cycles (talks to MPI)
        self.queue: collections.deque[Request] = collections.deque()
        # name -> handle of every collective submitted and not complete: names are unique
        # while in flight, and a failing engine fails every handle here.
        self.in_flight: dict[str, Handle] = {}
        self.failure: BaseException | None = None  # what ended the engine for good
        self.stop_requested = False
        self.join_handle: Handle | None = None
        self.ended = False  # a cycle shut the engine down (on whichever thread ran it)
        self.host_only = True  # no GPU collective yet: callers may run cycles
        self.handoff = False  # a driving caller left work in flight for the engine thread
        self.sleeping = False  # the engine thread waits for the bell (see `_sleep`)
        # What the engine thread sleeps on (`_sleep`) and `ring` wakes it with: a lock held
        # while nobody rang, released by the ringer (a C call on each side, where a
        # Condition's wait and notify were Python code of several microseconds each).
        self.bell = threading.Lock()
        self.bell.acquire()
        self.rings = 0  # how often `ring` woke the engine thread (for tests and benchmarks)
        self.waited_at = 0.0  # when a caller last began waiting for a handle (`drive`)
        self.idle_period = _idle_cycle_period(engine)
        self.thread = threading.Thread(target=self.run_engine_thread, name=thread_name, daemon=True)

    # ------------------------------------------------------------------ submissions
    def submit(self, request: Request, drive: bool) -> Handle:
        """Admit `request` (raise at once if it cannot be admitted); with `drive` (its
        caller waits for it at once) and the turn free, run its cycle here before returning
        (decided here, nowhere else), else queue it. The kinds submit here
        (`kinds.base.submit`, and a plain allreduce's own `_submit`)."""
        if request.signature.place == GPU:
            self.host_only = False  # the GPU plane keeps to the engine thread (its device)
        with self.lock:
            if self.failure is not None:
                raise self.failure
            if self.stop_requested:
                raise RingplugError("ringplug is shutting down; no new collectives can start.")
            if request.name in self.in_flight:
                raise ValueError(
                    f"A collective named {request.name!r} is already in flight on rank "
                    f"{self.engine.rank}; wait for it before submitting the same name again, or "
                    "give each tensor its own name."
                )
            self.in_flight[request.name] = request.handle
            request.submitted = time.perf_counter()
            if self.host_only:
                request.handle._engine = self  # its waiter may run the cycle (see `drive`)
            # Whether this caller, about to wait for its own collective, runs its cycle on
            # its thread now (the one place that decides it; written out, as this runs
            # every call): only host collectives so far (the GPU plane keeps to the engine
            # thread), nothing queued ahead of it, no join in progress, no cycle time to
            # gather more for fusion, and no other thread running a cycle (`turn`, taken
            # here, is released below).
            run_here = (
                drive
                and self.host_only
                and not self.queue
                and self.join_handle is None
                and self.engine.settings.cycle_time <= 0
                and self.turn.acquire(blocking=False)
            )
            if not run_here:
                record = self.engine.flight
                if record.capacity and request.name not in record.sites:
                    # Its flight entry is made when its cycle takes it; its site only here
                    # (`Cycle.run` finds a caller's own request's). The user's frame is
                    # usually the one above the kind's submission and its function.
                    record.note_site(request.name, 1, 0 if request.cacheable else 3)
                self.queue.append(request)
                if self.sleeping and not (drive and self.host_only):
                    self.ring()
        if run_here:
            try:
                self.engine.counters.cycles_by_callers += 1
                self.run_cycle([request], True)
            finally:
                self.turn.release()
            if not request.handle._done or self.engine.cycle.pending or self.queue:
                self._after_driving(request.handle)
        return request.handle

    def take_submissions(self, on_engine_thread: bool) -> tuple[list[Request], bool]:
        """The requests queued since the last cycle that this thread may run, and whether
        this rank is shutting down; marks a join as this cycle's."""
        with self.lock:
            fresh = list(self.queue)
            self.queue.clear()
            if not (on_engine_thread or self.host_only):
                # GPU collectives keep to the engine thread (the CUDA device is per thread):
                # a driving caller leaves them queued for it.
                self.queue.extend(r for r in fresh if r.signature.place == GPU)
                fresh = [r for r in fresh if r.signature.place != GPU]
                if self.queue:
                    self.handoff = True
                    self.ring()
            cycle = self.engine.cycle
            if self.join_handle is not None and not cycle.joined_cycle:
                cycle.joined_cycle = cycle.number + 1
            return fresh, self.stop_requested

    def let_burst_finish(self, deadline: float) -> None:
        """While a burst of requests still arrives back to back (at least `_BURST_LEAST`
        queued, the newest under `_BURST_GAP_SECONDS` old, and no caller has begun to wait
        since), step aside until `deadline`, so that the burst (a thousand tensors submitted
        in a loop) runs as one cycle instead of being cut where the engine thread got the
        GIL; a cycle cut there cost the burst a second negotiation."""
        queue = self.queue  # only appended to meanwhile: this thread holds the turn
        if len(queue) < _BURST_LEAST:
            return
        while True:
            now, newest = time.perf_counter(), queue[-1].submitted
            if now >= deadline or now - newest >= _BURST_GAP_SECONDS or self.waited_at > newest:
                return
            time.sleep(0)  # hands the GIL to the submitting thread

    # ------------------------------------------------------------------ waiting callers
    def drive(self, handle: Handle) -> None:
        """Run cycles on the calling thread until `handle` is done, while no other thread
        runs them and nothing else is in flight; hand the rest to the engine thread.

        A synchronous collective then costs no thread hand-off. With other requests in
        flight (asynchronous gradients, a request a peer has not submitted yet) the engine
        thread goes on running the cycles: their completion keeps the timing of the engine
        thread's polling, which Horovod's own tests of duplicate names rely on.
        """
        handle._engine = None
        self.waited_at = time.perf_counter()  # a burst of submissions ended here
        if threading.current_thread() is self.thread or not self.host_only:
            return
        if self.turn.acquire(timeout=_DRIVE_ACQUIRE_SECONDS):
            try:
                counters = self.engine.counters
                while not (handle._done or self.ended):
                    pending = self.engine.cycle.pending
                    if len(pending) > (handle.name in pending):
                        break  # the engine is not idle: its thread carries the work in flight
                    # Its own request is usually queued: no need to look further.
                    if not (self.queue or self._wait_for_work(handle)):
                        break
                    counters.cycles_by_callers += 1
                    if self.run_cycle(None, True):
                        break
            finally:
                self.turn.release()
        self._after_driving(handle)

    def _after_driving(self, handle: Handle) -> None:
        """A caller stopped running cycles (it released the turn): wake the engine thread
        when there is work left for it."""
        if not handle._done or self.engine.cycle.pending:
            with self.lock:
                self.handoff = True  # the engine thread takes over, polling as in flight
                self.ring()
        elif self.queue:
            with self.lock:
                self.ring()  # submitted meanwhile by another thread

    # ------------------------------------------------------------------ the engine thread
    def start(self) -> None:
        self.thread.start()

    def run_engine_thread(self) -> None:
        engine = self.engine
        try:
            while not self.ended:
                if not self._wait_for_work():
                    continue
                try:
                    if self.run_cycle(None, False):
                        return
                finally:
                    self.turn.release()
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear about it
            engine.thread_failed(exc, self.turn)
            self.ended = True

    def _wait_for_work(self, handle: Handle | None = None) -> bool:
        """Wait until there is a reason to run a cycle; True, holding the turn, when there
        is.

        On the engine thread (`handle` None), False means "look again". A caller driving
        `handle` already holds the turn; False tells it to stop: its handle is done, or the
        wait got long and the engine thread takes over.
        """
        engine = self.engine
        cycle = engine.cycle
        driving = handle is not None
        if driving:  # the usual case first: the caller's own request is queued
            with self.lock:
                if self.ended or handle._done or not self.host_only:
                    return False
                if self.queue or self.stop_requested:
                    return True
        delay = 20e-6
        retry_at = time.monotonic() + self.idle_period
        # Right after a cycle the next request or a peer's message is usually microseconds
        # away: poll, yielding the GIL, before sleeping (waking from a sleep costs more).
        # With nothing of ours in flight there is nothing to answer quickly: a local request
        # wakes the engine at once, and peers wait for that request anyway. Then the engine
        # sleeps 1 ms at a time, leaving the core to the training thread (polling more often
        # through the forward pass slows it on a rank with one core; see the constants).
        in_flight = bool(cycle.pending) or self.join_handle is not None or driving
        spin_until = time.perf_counter() + (_POLL_AFTER_CYCLE_SECONDS if in_flight else 0.0)
        if not in_flight:
            delay = IDLE_SLEEP_SECONDS
        connected = engine.exchange.comm is not None
        while True:
            with self.lock:
                if self.ended or (driving and (handle._done or not self.host_only)):
                    return False
                if not driving and self.handoff:
                    self.handoff = False  # a caller left work in flight: poll as in flight
                    return False
                ready = bool(self.queue or self.stop_requested) or (
                    self.join_handle is not None and not cycle.joined_cycle
                )
            if not ready and (cycle.pending or cycle.joined_cycle):
                ready = time.monotonic() >= retry_at  # look again, for the stall inspector
            # Without the turn a caller is running the cycles: wait below.
            if (ready or connected) and (driving or self.turn.acquire(blocking=False)):
                if not ready:
                    ready = engine.exchange.peer_started()
                    if not (ready or driving) and time.perf_counter() >= spin_until:
                        engine.waiter.answer_waiting_peers()
                if ready:
                    return True
                if not driving:
                    self.turn.release()
            elif not driving and (ready or connected):
                # A caller drives the cycles: sleep until it hands over (it rings) instead
                # of polling beside it, which took the GIL and a core from it on every MPI call.
                with self.lock:
                    asleep = not (self.handoff or self.stop_requested or self.ended)
                    if asleep:
                        self._fall_asleep()
                if asleep:
                    self._sleep(_DRIVEN_SLEEP_SECONDS)
                continue
            if engine.size == 1 and not cycle.pending:
                if driving:
                    return False
                with self.lock:
                    asleep = not (self.queue or self.stop_requested or self.join_handle)
                    if asleep:
                        self._fall_asleep()
                if asleep:
                    self._sleep(0.05)
                return False
            if time.perf_counter() < spin_until:
                time.sleep(0)
                continue
            if driving:
                return False  # a long wait: the engine thread polls and the caller sleeps
            with self.lock:
                asleep = not (self.queue or self.stop_requested or self.handoff)
                if asleep:
                    self._fall_asleep()
            if asleep:
                self._sleep(delay)
            if in_flight:
                delay = next_delay(delay, engine.counters.last_activity)

    def _fall_asleep(self) -> None:
        """Mark the engine thread asleep (`lock` held, after finding no reason to run a
        cycle), so that the next `ring` wakes it; a ring left from before is dropped."""
        self.bell.acquire(blocking=False)
        self.sleeping = True

    def _sleep(self, seconds: float) -> None:
        """Sleep (`lock` not held) for at most `seconds`, or until rung. A ring between
        `_fall_asleep` and here is not lost: the bell is released, and this returns at once.
        `sleeping` tells `submit` whether anyone sleeps (only the engine thread does):
        ringing nobody cost 0.5 us of every asynchronous submission."""
        if self.bell.acquire(timeout=seconds):
            return  # rung: `ring` took `sleeping` back
        self.sleeping = False

    def ring(self) -> None:
        """Wake the engine thread if it sleeps (`lock` held: one ring per sleep)."""
        if self.sleeping:
            self.sleeping = False
            self.rings += 1
            self.bell.release()

    def wake(self) -> None:
        """Wake the engine thread (a join, a stop)."""
        with self.lock:
            self.ring()


def _idle_cycle_period(engine: Scheduled) -> float:
    """How often the engine looks again while a request waits for its peers (for the
    stall inspector)."""
    settings = engine.settings
    return min(max(min(settings.stall_check_seconds, settings.timeout) / 4, 0.05), 1.0)
