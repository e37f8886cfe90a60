"""The engine: negotiates, fuses and runs the collectives of one process.

Callers (the user's thread, autograd hooks, a Keras step) submit requests and get a
`Handle`. Work goes in cycles, each run by whichever thread holds the engine's MPI lock
(the one thread talking to MPI at a time):

1. take what was submitted since the last cycle;
2. negotiate (`exchange`): every rank gets every rank's message, with what is ready there
   (a bit vector for requests agreed before, name and signature for new ones), in
   ceil(log2 p) rounds; `negotiation.decide` turns the messages into the same plan on
   every rank;
3. run the plan: every collective through its kind's object (`kinds.kind.kind_of`):
   consecutive requests of a kind that fuses (allreduce) in one batch (`batches`), every
   other one alone;
4. complete the handles, record the timeline, and check for stalls (`stalls`).

Who runs a cycle: a caller that waits for its collective runs it itself when the engine
is free (a synchronous collective then costs no hand-off between threads); otherwise the
engine's own thread does, which is what lets asynchronous collectives overlap the
caller's work. An idle engine thread sleeps on a condition variable and polls for peers'
messages with a growing interval (at most 1 ms), so a waiting rank uses almost no CPU.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ... import wire
from ...config import Settings
from ...forensics import flight
from ...forensics.flight import FlightRecorder
from ...forensics.stacks import own_stacks, report_lines
from ...wire import GPU, UNNAMED, Kind, Message, Response, Signature, cacheable_name
from .. import activity, autotune, log
from ..algorithms import ALLREDUCE, CANDIDATES, HIERARCHICAL, AlgorithmTable
from ..dtypes import ITEMSIZE
from ..errors import (
    CommunicatorFailed,
    MismatchError,
    PeerArgumentError,
    PeerEngineFailedError,
    PeerFailedError,
    PeerLeftError,
    RingplugError,
)
from ..kinds.kind import SameEverywhere, check_joined, kind_of
from ..timeline import Timeline
from ..transport.host import Transport
from ..transport.traffic import Traffic
from ..transport.waiting import IDLE_SLEEP_SECONDS, Waiter, next_delay, peer_failed_error
from . import carried
from .batches import batches
from .exchange import Exchange, gathers_only
from .express import ExpressCycles
from .handles import Handle, Request, finish_each, wake_waiters
from .negotiation import Cache, Plan, decide
from .stalls import StallInspector

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..gpu.plane import GpuPlane

__all__ = ["Engine", "Handle", "Request"]

logger = logging.getLogger(__name__)

# After a cycle, the next submission or a peer's next message is usually well under a
# millisecond away; poll (yielding the GIL and the core) that long before sleeping.
_POLL_AFTER_CYCLE_SECONDS = 1e-3
_CACHE_CAPACITY = 4096
# A burst of asynchronous submissions runs as one cycle: with at least `_BURST_LEAST`
# requests queued, the engine thread steps aside while the newest is younger than the gap,
# for at most the wait (`_let_burst_finish`). Without it the engine thread takes the GIL at
# CPython's switch interval, in the middle of the loop, and a burst costs two negotiations
# (figures: docs/benchmarks.md, "Design measurements"). A few gradient buckets, or
# gradients that a backward pass hands over further apart than the gap, run at once.
_BURST_LEAST = 64
_BURST_GAP_SECONDS = 300e-6
_BURST_WAIT_SECONDS = 1e-3
# A caller about to wait for its collective takes the cycles over from the engine thread
# when that is free within this long (it holds `_mpi` only to look for work, or to run a
# cycle that has deadlines of its own); otherwise the engine thread runs them.
_DRIVE_ACQUIRE_SECONDS = 1e-3
# While a caller drives, the engine thread sleeps until the caller hands over (it notifies);
# this is only a backstop. Waking often to look slows a caller spinning in an Iallreduce:
# the woken thread takes the GIL from it (figures: docs/benchmarks.md, "Design measurements").
_DRIVEN_SLEEP_SECONDS = 0.05


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Engine(ExpressCycles):
    """Negotiates, fuses and runs the collectives of one process, on its own thread."""

    def __init__(
        self,
        comm: MPI.Comm | None,
        settings: Settings,
        local_rank: int = 0,
        local_size: int = 1,
        ranks: tuple[int, ...] | None = None,
        thread_name: str = "ringplug-engine",
    ) -> None:
        """`ranks`: for a process set's engine (`comm` holds its members only), the world's
        rank of each member, by which its errors, stall reports and records name them."""
        self.settings = settings
        self.ranks = ranks
        self._idle_period = self._idle_cycle_period(settings)
        self.local_rank = local_rank
        self._gpu: GpuPlane | None = None  # made at the first GPU collective
        self.transport = Transport(comm, settings)
        self.rank, self.size = self.transport.rank, self.transport.size
        self.world_rank = ranks[self.rank] if ranks is not None else self.rank
        # The process sets' engines, which write to this engine's timeline (`process_sets`).
        self.followers: list[Engine] = []
        self._scope_text = ""
        self._ctrl = comm.Dup() if comm is not None else None
        # Every wait of this engine (negotiation, ring, MPI collectives) has its deadline.
        self.waiter = Waiter(self._ctrl, settings, self.rank, self.size, ranks)
        self.transport.waiter = self.waiter
        self._exchange = Exchange(self._ctrl, self.waiter, self.rank, self.size)
        if local_size <= _cores():
            self.waiter.spin_with_a_core_each()
        self._renew = False  # a collective was abandoned: renew the data communicator
        # This rank ended ringplug while peers still waited for it, or its engine or a peer's
        # ended for good: MPI_Finalize would wait for ranks that never come (see runtime).
        self.left_early = False
        # `_mutex` is `_lock`'s own lock: the hot paths that never wait or notify take it
        # directly (a Condition's `with` is a Python call around the C one).
        self._mutex = threading.RLock()
        self._lock = threading.Condition(self._mutex)
        self._sleeping = False  # the engine thread waits on `_lock` (see `_sleep`)
        self._waited_at = 0.0  # when a caller last began waiting for a handle (`drive`)
        self._queue: collections.deque[Request] = collections.deque()
        # name -> handle of every collective submitted and not complete (None: a request-less
        # `call_now`, which its caller runs): names are unique while in flight, and a
        # failing engine fails every handle here, including a batch it was running.
        self._in_flight: dict[str, Handle | None] = {}
        self.pending: dict[str, Request] = {}  # engine thread only
        self._cache = Cache(_CACHE_CAPACITY, eager_threshold(settings, self.size))
        # This cycle's data carried in the messages: name -> every rank's copy (`carried`).
        self.carried_copies: dict[str, list[memoryview]] = {}
        self._cycle = 0
        # What the kinds keep per engine, by kind label (allreduce: its fusion buffer).
        self.kind_state: dict[str, Any] = {}
        self._last_batches: tuple[list[Response], list[list[Response] | Response]] | None = None
        self._failure: BaseException | None = None
        self._failed_here: PeerFailedError | None = None  # a collective of this cycle failed
        self._position = 0  # of the next collective in this cycle's plan
        self._stop_requested = False
        self._joined_cycle = 0
        self._join_handle: Handle | None = None
        self._unnamed_next = 1  # the number of the next unnamed request ("noname.N")
        # call_now's agreed forms: (name or prefix, signature) -> the cache's signature of
        # it and its slot.
        self._agreed: dict[tuple[Any, ...], tuple[Signature, int]] = {}
        self._stalls = StallInspector(settings, self.rank, self.size, ranks)
        # The last collectives of this rank, for stall reports (`forensics.flight`).
        self.flight = FlightRecorder(settings.flight_record)
        self._flight_written = False  # after a failure, once
        log.before_end.append(self._last_words)
        # The timeline being recorded (rank 0 only); framework adapters add their tracks.
        self.timeline: Timeline | None = None
        self._timeline_lock = threading.Lock()
        self.cycles_run = 0
        self.cycles_by_callers = 0  # of those, run by a waiting caller (`drive`; tests read it)
        self.express_cycles = 0  # of those, express cycles that ran their request (`_express`)
        self.calls_now = 0  # of those, synchronous calls run without a request (`call_now`)
        self._last_activity = time.perf_counter()  # end of the last cycle that ran something
        self.collectives_run = 0  # fused batches count once (tests count them)
        if settings.timeline:
            self.start_timeline(settings.timeline)
        # The allreduce algorithm autotune applied ("": the table's) and the table before it.
        self._tuned_algorithm = ""
        self._untuned_table: AlgorithmTable | None = None
        # RINGPLUG_AUTOTUNE: the world's engine tells its tuner each cycle's plan (`_execute`).
        self.tuner = autotune.for_engine(self) if settings.autotune and ranks is None else None
        # Whoever holds `_mpi` runs cycles and is the one thread talking to MPI: the engine
        # thread, or a caller waiting for its synchronous collective (see `drive`).
        self._mpi = threading.Lock()
        self._handoff = False  # a driving caller left work in flight for the engine thread
        self._host_only = True  # no GPU collective yet: callers may drive
        self._ended = False  # a cycle shut the engine down (on whichever thread ran it)
        self._thread = threading.Thread(target=self._main, name=thread_name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers' side
    def submit(self, request: Request, drive: bool = False) -> Handle:
        """Queue `request` for the engine thread; raise at once if it cannot be queued.

        With `drive`, the caller is about to wait for the handle (a synchronous collective):
        the engine thread is not woken. With nothing else queued and the engine free, the
        request's cycle runs here, before `submit` returns (`_express_now`); otherwise
        `wait()` runs the cycles on the caller's thread when the engine is free (`drive`).
        """
        if request.signature.place == GPU:
            self._host_only = False  # the GPU plane keeps to the engine thread (its device)
        with self._mutex:
            if self._failure is not None:
                raise self._failure
            if self._stop_requested:
                raise RingplugError("ringplug is shutting down; no new collectives can start.")
            if request.name in self._in_flight:
                raise ValueError(
                    f"A collective named {request.name!r} is already in flight on rank "
                    f"{self.rank}; wait for it before submitting the same name again, or give "
                    "each tensor its own name."
                )
            self._in_flight[request.name] = request.handle
            request.submitted = time.perf_counter()
            record = self.flight
            if record.capacity and request.name not in record.sites:
                record.note_site(request.name)  # the entry itself: `_take_submissions`
            if self._host_only:
                request.handle._engine = self  # its waiter may run the cycle (see `drive`)
            # A caller about to wait, with nothing else queued: its cycle runs here and now
            # (`_express`), without queueing it and waking anyone.
            express = drive and self._caller_may_run()
            if not express:
                self._queue.append(request)
                if self._sleeping and not (drive and self._host_only):
                    self._sleeping = False  # woken: later submissions need not notify
                    self._lock.notify_all()
        if express:
            self._express_now(request)
        return request.handle

    def _caller_may_run(self) -> bool:
        """Whether a caller about to wait for its own collective may run its cycle on its
        thread now (the caller holds `_mutex`): only host collectives so far (the GPU plane
        keeps to the engine thread), nothing queued ahead of it, no join in progress, no
        cycle time to gather more for fusion, and no other thread running a cycle. True
        with `_mpi` taken: the caller releases it.

        The one place that decides it, for `submit`'s express cycle and for `call_now`.
        """
        return (
            self._host_only
            and not self._queue
            and self._join_handle is None
            and self.settings.cycle_time <= 0
            and self._mpi.acquire(blocking=False)
        )

    def _express_now(self, request: Request) -> None:
        """Run `request`'s express cycle on the caller's thread, which holds `_mpi`, or
        queue it for the caller's wait when it needs the usual path (see `_express`)."""
        try:
            if self._guarded_cycle(request) is None:
                # Queued while this thread still holds `_mpi`: no cycle can fail everything
                # in between and miss it.
                with self._lock:
                    self._queue.append(request)
                return
            self.cycles_by_callers += 1
        finally:
            self._mpi.release()
        self._after_driving(request.handle)

    def drive(self, handle: Handle) -> None:
        """Run engine cycles on the calling thread until `handle` is done, while no other
        thread runs them and nothing else is in flight; hand the rest to the engine thread.

        A synchronous collective then costs no thread hand-off: the caller that would sleep
        until the engine thread woke, negotiated, ran the collective and woke it again does
        that work itself. Whoever holds `_mpi` is the one thread talking to MPI. With other
        requests in flight (asynchronous gradients, a request a peer has not submitted yet)
        the engine thread goes on running the cycles: their completion keeps the timing of
        the engine thread's polling, which Horovod's own tests of duplicate names rely on.
        """
        handle._engine = None
        self._waited_at = time.perf_counter()  # a burst of submissions ended here
        if threading.current_thread() is self._thread or not self._host_only:
            return
        if self._mpi.acquire(timeout=_DRIVE_ACQUIRE_SECONDS):
            try:
                while not (handle._done or self._ended):
                    pending = self.pending
                    if len(pending) > (handle.name in pending):
                        break  # the engine is not idle: its thread carries the work in flight
                    # Its own request is usually queued: no need to look further.
                    if not (self._queue or self._wait_for_work(handle)):
                        break
                    self.cycles_by_callers += 1
                    if self._guarded_cycle():
                        break
            finally:
                self._mpi.release()
        self._after_driving(handle)

    def _after_driving(self, handle: Handle) -> None:
        """A caller stopped running cycles (it released `_mpi`): wake the engine thread when
        there is work left for it."""
        if not handle._done or self.pending:
            with self._lock:
                self._handoff = True  # the engine thread takes over, polling as in flight
                self._lock.notify_all()
        elif self._queue:
            with self._lock:
                self._lock.notify_all()  # submitted meanwhile by another thread

    def unnamed(self) -> str:
        """A name for an unnamed request: "noname.1", "noname.2", ... in call order (the
        same sequence on every rank, restarting with each init())."""
        return f"{UNNAMED}{self.unnamed_number()}"

    def unnamed_number(self) -> int:
        """The number of the next unnamed request (see `unnamed`)."""
        with self._mutex:
            number, self._unnamed_next = self._unnamed_next, self._unnamed_next + 1
        return number

    def _follow_unnamed(self, names: Iterable[str]) -> None:
        """A joined rank takes part in the others' unnamed requests without calling them:
        move its numbering past theirs, so that its calls after join() match theirs."""
        highest = 0
        for name in names:
            if name.startswith(UNNAMED) and name not in self.pending:
                number = name[len(UNNAMED) :]
                if number.isdigit():
                    highest = max(highest, int(number))
        if highest:
            with self._lock:
                self._unnamed_next = max(self._unnamed_next, highest + 1)

    def join(self) -> Handle:
        """Declare that this rank has no more data; see `ringplug.join`."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._join_handle is not None:
                raise ValueError("join() is already in progress on this rank.")
            self._join_handle = Handle("join")
            self._lock.notify_all()
            return self._join_handle

    def stop(self, timeout: float = 60.0) -> None:
        """Shut the engine down on every rank, finishing what already ran. Idempotent."""
        with self._lock:
            self._stop_requested = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the ringplug engine thread did not stop within %.0f s", timeout)
            return
        if self._last_words in log.before_end:
            log.before_end.remove(self._last_words)
        self.stop_timeline()
        if self.tuner is not None:
            self.tuner.close()
        if self._gpu is not None:
            self._gpu.close()
        if self._ctrl is not None:
            self._ctrl.Free()
            self._ctrl = None
        self.transport.free()

    def start_timeline(self, path: str) -> None:
        """Record a timeline to `path` (rank 0 writes; other ranks ignore the call)."""
        if self.rank != 0:
            return
        with self._timeline_lock:
            if self.timeline is not None:
                self.timeline.stop()
            self.timeline = Timeline(path, self.rank)
            for follower in self.followers:
                follower.timeline = self.timeline

    def stop_timeline(self) -> None:
        with self._timeline_lock:
            for follower in self.followers:
                follower.timeline = None
            if self.timeline is not None:
                self.timeline.stop()
                self.timeline = None

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            while not self._ended:
                if not self._wait_for_work():
                    continue
                try:
                    if self._guarded_cycle():
                        return
                finally:
                    self._mpi.release()
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear about it
            logger.exception("the ringplug engine failed")
            if self._mpi.acquire(blocking=False):  # held elsewhere: peers learn at the timeout
                try:
                    self._tell_peers_it_ended(exc)
                finally:
                    self._mpi.release()
            self.fail_everything(RingplugError(f"the ringplug engine failed: {exc}"))
            self._ended = True

    def _guarded_cycle(self, express: Request | None = None) -> bool | None:
        """Run one cycle (`_run_cycle`, or the express cycle of `express`); True when the
        engine should stop (shut down, or it failed), None when the express cycle ran
        nothing."""
        try:
            if express is None:
                stop = self._run_cycle()
            else:
                stop = self._express(express, express.submitted)
            if stop is not None:
                self._ended = stop
            return stop
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear about it
            self._cycle_failed(exc)
            return True

    def _cycle_failed(self, exc: BaseException) -> None:
        """A cycle raised `exc`: fail everything in flight with it (or with what it says)
        and end the engine; re-raise what is not an Exception (KeyboardInterrupt)."""
        self._ended = True
        if isinstance(exc, CommunicatorFailed):
            logger.error("%s", exc)
            self.fail_everything(exc)
            return
        if isinstance(exc, PeerEngineFailedError):  # a peer's final notice
            logger.error("%s", exc)
            self.left_early = True  # MPI_Finalize would wait for that peer
            self.fail_everything(exc)
            return
        self._tell_peers_it_ended(exc)
        if not isinstance(exc, Exception):  # e.g. KeyboardInterrupt in a driving caller
            self.fail_everything(
                RingplugError(
                    f"ringplug was interrupted ({type(exc).__name__}) in the middle of a "
                    "collective on this rank; it cannot continue in this process."
                )
            )
            raise exc
        logger.exception("the ringplug engine failed", exc_info=exc)
        self.fail_everything(RingplugError(f"the ringplug engine failed: {exc}"))

    def _tell_peers_it_ended(self, exc: BaseException) -> None:
        """Send every peer a final notice (the caller holds `_mpi`): their waits fail at once
        with this text instead of naming this rank as frozen at the timeout."""
        self.left_early = True  # the peers stop too, without MPI_Finalize
        try:
            self.waiter.announce_end(f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - MPI itself may be what failed
            logger.warning("could not tell the other ranks that this engine failed", exc_info=True)

    def _wait_for_work(self, handle: Handle | None = None) -> bool:
        """Wait until there is a reason to run a cycle; True, holding `_mpi`, when there is.

        On the engine thread (`handle` None), False means "look again". A caller driving
        `handle` already holds `_mpi`; False tells it to stop: its handle is done, or the
        wait got long and the engine thread takes over.
        """
        driving = handle is not None
        if driving:  # the usual case first: the caller's own request is queued
            with self._lock:
                if self._ended or handle._done or not self._host_only:
                    return False
                if self._queue or self._stop_requested:
                    return True
        delay = 20e-6
        retry_at = time.monotonic() + self._idle_period
        # Right after a cycle the next request or a peer's message is usually microseconds
        # away: poll, yielding the GIL, before sleeping (waking from a sleep costs more).
        # With nothing of ours in flight there is nothing to answer quickly: a local request
        # wakes the engine at once, and peers wait for that request anyway. Then the engine
        # sleeps 1 ms at a time, leaving the core to the training thread (polling more often
        # through the forward pass slows it on a rank with one core; see the module's
        # constants).
        in_flight = bool(self.pending) or self._join_handle is not None or driving
        spin_until = time.perf_counter() + (_POLL_AFTER_CYCLE_SECONDS if in_flight else 0.0)
        if not in_flight:
            delay = IDLE_SLEEP_SECONDS
        while True:
            with self._lock:
                if self._ended or (driving and (handle._done or not self._host_only)):
                    return False
                if not driving and self._handoff:
                    self._handoff = False  # a caller left work in flight: poll as in flight
                    return False
                ready = bool(self._queue or self._stop_requested) or (
                    self._join_handle is not None and not self._joined_cycle
                )
            if not ready and (self.pending or self._joined_cycle):
                ready = time.monotonic() >= retry_at  # look again, for the stall inspector
            # Without `_mpi` a caller is running the cycles: wait below.
            if (ready or self._ctrl is not None) and (driving or self._mpi.acquire(blocking=False)):
                if not ready:
                    ready = self._exchange.peer_started()
                    if not (ready or driving) and time.perf_counter() >= spin_until:
                        self.waiter.answer_waiting_peers()
                if ready:
                    return True
                if not driving:
                    self._mpi.release()
            elif not driving and (ready or self._ctrl is not None):
                # A caller drives the cycles: sleep until it hands over (it notifies) instead
                # of polling beside it, which took the GIL and a core from it on every MPI call.
                with self._lock:
                    if not (self._handoff or self._stop_requested or self._ended):
                        self._sleep(_DRIVEN_SLEEP_SECONDS)
                continue
            if self.size == 1 and not self.pending:
                if driving:
                    return False
                with self._lock:
                    if not (self._queue or self._stop_requested or self._join_handle):
                        self._sleep(0.05)
                return False
            if time.perf_counter() < spin_until:
                time.sleep(0)
                continue
            if driving:
                return False  # a long wait: the engine thread polls and the caller sleeps
            with self._lock:
                if not (self._queue or self._stop_requested or self._handoff):
                    self._sleep(delay)
            if in_flight:
                delay = next_delay(delay, self._last_activity)

    def _sleep(self, seconds: float) -> None:
        """Wait on `_lock` (held) for at most `seconds`, or until notified. `_sleeping` tells
        `submit` whether anyone waits there (only the engine thread does): notifying nobody
        cost 0.5 us of every asynchronous submission."""
        self._sleeping = True
        try:
            self._lock.wait(seconds)
        finally:
            self._sleeping = False

    @staticmethod
    def _idle_cycle_period(settings: Settings) -> float:
        """How often the engine looks again while a request waits for its peers (for the
        stall inspector)."""
        return min(max(min(settings.stall_check_seconds, settings.timeout) / 4, 0.05), 1.0)

    def _run_cycle(self) -> bool:
        """One negotiation and its plan; True when the engine should stop."""
        cycle_start = time.perf_counter()
        if self.settings.cycle_time > 0:
            time.sleep(self.settings.cycle_time)  # let more requests gather for fusion
        elif threading.current_thread() is self._thread:
            self._let_burst_finish(cycle_start + _BURST_WAIT_SECONDS)
        fresh, stopping = self._take_submissions()
        if len(fresh) == 1 and not stopping:
            stop = self._express(fresh[0], cycle_start)
            if stop is not None:
                return stop
        for request in fresh:
            request.announced = cycle_start
            self.pending[request.name] = request
        self._cycle += 1
        own = self._message(stopping)
        messages, alike = self._exchange.exchange(self._cycle, own, self.pending)
        return self._follow(messages, alike, cycle_start)

    def _let_burst_finish(self, deadline: float) -> None:
        """While a burst of requests still arrives back to back (at least `_BURST_LEAST`
        queued, the newest under `_BURST_GAP_SECONDS` old, and no caller has begun to wait
        since), step aside until `deadline`, so that the burst (a thousand tensors submitted
        in a loop) runs as one cycle instead of being cut where the engine thread got the
        GIL; a cycle cut there cost the burst a second negotiation."""
        queue = self._queue  # only appended to meanwhile: this thread holds `_mpi`
        if len(queue) < _BURST_LEAST:
            return
        while True:
            now, newest = time.perf_counter(), queue[-1].submitted
            if now >= deadline or now - newest >= _BURST_GAP_SECONDS or self._waited_at > newest:
                return
            time.sleep(0)  # hands the GIL to the submitting thread

    def _take_submissions(self) -> tuple[list[Request], bool]:
        """The requests submitted since the last cycle (that this thread may run), and
        whether this rank is shutting down."""
        on_engine_thread = threading.current_thread() is self._thread
        with self._lock:
            fresh = list(self._queue)
            self._queue.clear()
            if not (on_engine_thread or self._host_only):
                # GPU collectives keep to the engine thread (the CUDA device is per thread):
                # a driving caller leaves them queued for it.
                self._queue.extend(r for r in fresh if r.signature.place == GPU)
                fresh = [r for r in fresh if r.signature.place != GPU]
                if self._queue:
                    self._handoff = True
                    self._lock.notify_all()
            if self._join_handle is not None and not self._joined_cycle:
                self._joined_cycle = self._cycle + 1
            stopping = self._stop_requested
        if self.flight.capacity:  # here, on the thread that runs the cycles, not the caller's
            self.flight.add_latest(fresh)
        return fresh, stopping

    def _follow(self, messages: list[Message], alike: bool, cycle_start: float) -> bool:
        """Decide this cycle's plan from every rank's message and run it; True when the
        engine should stop."""
        if messages[0] is not messages[-1] or len(messages) == 1:
            # For the stall reports (a cycle the ranks agreed on without gathering their
            # messages left the peers' phases unknown: the last ones known stay).
            self._stalls.activities = [m.activity for m in messages]
        if messages[0].report:  # rank 0 saw a stall: show where this rank is
            self.report_where("rank 0 saw it stall", self.rank in messages[0].report)
        plan = decide(messages, self._cache, alike, self.ranks)
        self.carried_copies = carried.received(messages, self._cache, plan.repeated)
        self.cycles_run += 1
        if plan.shutdown_by is not None:
            if plan.shutdown_by == self.rank:
                self.left_early = any(
                    (m.cached or m.new) and not m.shutdown
                    for r, m in enumerate(messages)
                    if r != self.rank
                )
            self._shut_down(plan.shutdown_by)
            return True
        if any(m.renew for m in messages) and self._ctrl is not None:
            self.transport.renew(self._ctrl)
        if not plan.nothing_new:
            cacheable = {n for n, r in self.pending.items() if r.cacheable}
            # A joined rank lacks the others' requests; it must still learn the same slots
            # (given names are the cacheable ones), or its cache parts from theirs.
            cacheable.update(
                r.name
                for r in plan.responses
                if r.name not in self.pending and cacheable_name(r.name)
            )
            self._cache.learn(plan, cacheable)
        self._execute(plan)
        stalled = self._stalls.inspect(plan, self.pending)
        if stalled is not None:
            self.fail_everything(stalled)
        for name, error in self._stalls.take_expired():  # a barrier's own timeout passed
            self.complete(self.pending.pop(name), error=error)
        if plan.all_joined:
            self._finish_join(plan.last_joined)
        wake_waiters()
        if plan.responses or plan.errors:
            self._last_activity = time.perf_counter()
        timeline = self.timeline
        if timeline is not None:
            timeline.marker(f"cycle {self._cycle}", cycle_start, ran=len(plan.responses))
            timeline.flush()
        return False

    def _message(self, stopping: bool) -> Message:
        message = Message(self._cycle, joined_cycle=self._joined_cycle, shutdown=stopping)
        message.renew, self._renew = self._renew, False
        message.activity = activity.current()
        cache = self._cache
        for name, request in self.pending.items():
            if request.cacheable:
                slot = cache.slot_for(name, request.signature)
                if slot is not None:
                    message.cached |= 1 << slot
                    continue
            else:
                entry = cache.numbered_slot(name, request.signature)
                if entry is not None:
                    message.numbered.append(entry)
                    continue
            message.new.append((name, request.signature, request.extra))
        if cache.eager_mask:
            message.eager = carried.pack(message, self.pending, cache)
        message.stall_abort = self._stalls.take_abort()
        message.report = self._stalls.take_report()
        return message

    # ------------------------------------------------------------------ running a plan
    def _execute(self, plan: Plan) -> None:
        if self._join_handle is not None:
            self._follow_unnamed([r.name for r in plan.responses] + list(plan.errors))
        for name, message in plan.errors.items():
            request = self.pending.pop(name, None)
            if request is not None:
                self.complete(request, error=_mismatch_error(request, message + self.scope_text))
        self._failed_here = None
        self._position = 0
        for item in self._batches(plan.responses):
            if isinstance(item, list):
                kind_of(item[0].signature.kind).run_batch(self, item)
            else:
                self._run_single(item)
        if self.tuner is not None:  # the same plan at the same cycle on every rank
            self.tuner.after_cycle(self._cycle, plan.responses)

    def apply_tuned_setting(
        self, fusion_threshold: int, cycle_time: float, algorithm: str = ""
    ) -> None:
        """Make the autotuner's setting this engine's from the next cycle on (every rank
        calls it at the end of the same cycle): the fusion threshold (bytes), the cycle time
        (seconds) and the host allreduce's algorithm (``""``: the algorithm table's choice
        by size; a name: that one at every size, as ``RINGPLUG_ALGORITHM=allreduce=NAME``)."""
        self.settings = dataclasses.replace(
            self.settings, fusion_threshold=fusion_threshold, cycle_time=cycle_time
        )
        self._last_batches = None  # batched by the old threshold
        if self._gpu is not None:
            self._gpu.settings = self.settings
        if algorithm != self._tuned_algorithm:
            # The table as it was before any tuned algorithm (made collectively at the first
            # collective that chose one; here, if not yet, at this cycle on every rank).
            if self._untuned_table is None:
                self._untuned_table = self.transport.algorithms
            table = self._untuned_table
            self.transport.use_algorithms(
                table.forcing({ALLREDUCE: algorithm}) if algorithm else table
            )
            self._tuned_algorithm = algorithm

    def tunable_algorithms(self) -> tuple[tuple[str, ...], Callable[[int], str]]:
        """What autotune may try for the host allreduce (every rank calls it at the same
        cycle; collective the first time): the algorithms of the table's allreduce row,
        the hierarchical one only where the ranks span hosts (`Transport.spans_hosts`),
        and the one the table takes for a buffer of so many bytes. None where
        ``RINGPLUG_ALGORITHM`` forces the allreduce, on one rank, or once a GPU collective
        ran (NCCL's allreduce is not the table's)."""
        if self.size == 1 or ALLREDUCE in self.transport.forced or not self._host_only:
            return (), lambda nbytes: ""
        table = self.transport.algorithms
        names = tuple(
            name
            for name in CANDIDATES[(ALLREDUCE, True)]
            if name != HIERARCHICAL or self.transport.spans_hosts()
        )
        return names, lambda nbytes: table.choose(ALLREDUCE, nbytes, True)

    def _batches(self, responses: list[Response]) -> list[list[Response] | Response]:
        """`fusion.batches` of this plan's responses: the last plan's own batches when it ran
        the same list (a repeated step, see `Cache.repeated`)."""
        last = self._last_batches
        if last is not None and last[0] is responses:  # kept alive here: `is` is safe
            return last[1]
        found = list(batches(responses, self.settings.fusion_threshold))
        self._last_batches = (responses, found)
        return found

    @property
    def scope_text(self) -> str:
        """What this engine's mismatch errors and stall reports add: which process set
        (empty for the world)."""
        return self._scope_text

    @scope_text.setter
    def scope_text(self, text: str) -> None:
        self._scope_text = text
        self._stalls.scope_text = text

    def gpu_plane(self) -> GpuPlane:
        """The GPU data plane (NCCL), made at the first GPU collective."""
        if self._gpu is None:
            from ..gpu.plane import GpuPlane  # only GPU jobs load NCCL

            self._gpu = GpuPlane(self.transport, self.settings, self.local_rank)
        return self._gpu

    def begin_collective(self, kind: str, responses: list[Response]) -> PeerFailedError | None:
        """Name the collective the next waits belong to (its position in the plan is the
        same on every rank). Returns the error to fail it with when an earlier collective of
        this cycle failed (the ranks then left the data communicator), else None."""
        fused = f" (fused with {len(responses) - 1} more)" if len(responses) > 1 else ""
        what = f"{kind} {responses[0].name!r}{fused}"
        self.waiter.begin(self._cycle, self._position, what)
        self._position += 1
        cause = self._failed_here
        if cause is None:
            # A peer that failed this collective before this rank got here may have said so
            # already: do not start what it will never take part in.
            notice = self.waiter.peer_failure()
            if notice is None:
                return None
            if notice.final:  # so is every later one; the next negotiation ends the engine
                return peer_failed_error(notice, what)
            cause = peer_failed_error(notice, notice.what)  # "rank r failed X: text"
            self._failed_here, self._renew = cause, True
            if notice.what == what:
                return cause
        return PeerFailedError(f"{what} did not run: {cause}", caused_by=cause.caused_by)

    def collective_failed(self, exc: BaseException, requests: list[Request | None]) -> None:
        """A collective failed while running: fail its requests here, and make sure every
        peer hears of it instead of waiting for this rank forever."""
        if isinstance(exc, PeerFailedError):
            cause = exc
        else:
            text = f"{type(exc).__name__}: {exc}"
            logger.error("rank %d failed %s: %s", self.world_rank, self.waiter.what, text)
            self.waiter.announce_failure(text)
            cause = PeerFailedError(f"rank {self.world_rank} failed {self.waiter.what}: {text}")
        self._renew = True  # its operations may still be posted: leave the communicator
        self._failed_here = cause
        self.complete_each(requests, error=exc)

    def _run_single(self, response: Response) -> None:
        """Run a collective that is not fused (everything but allreduce) through its kind."""
        signature = response.signature
        request = self.pending.pop(response.name, None)
        if signature.kind is Kind.ERROR:  # every rank rejected its arguments: each raises its own
            if request is not None:
                self.complete(request, error=request.error)
            return
        collective = kind_of(signature.kind)
        start = time.perf_counter()
        if signature.place != GPU:
            skipped = self.begin_collective(collective.label, [response])
            if skipped is not None:
                self.complete_each([request], error=skipped)
                return
        try:
            check_joined(signature, response)
            if signature.place == GPU:
                result = collective.run_gpu(self, response, request)
            else:
                result = collective.run_host(self, response, request)
        except CommunicatorFailed as exc:
            if request is not None:
                self.complete(request, error=exc)
            raise  # every other GPU collective must fail too
        except SameEverywhere as exc:  # raised alike on every rank, before any data moved
            if request is not None:
                self.complete(request, error=exc)
            return
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or peers hang
            if signature.place == GPU:
                if request is not None:
                    self.complete(request, error=exc)
                return
            self.collective_failed(exc, [request])
            return
        self.collectives_run += 1
        if request is not None:
            self.complete(request, result=result)
            timeline = self.timeline
            if timeline is not None:
                self.trace_wait(timeline, request, start)
                timeline.span(request.name, signature.kind.name, start, time.perf_counter())

    @staticmethod
    def trace_wait(timeline: Timeline, request: Request, start: float) -> None:
        timeline.span(request.name, "QUEUE", request.submitted, request.announced)
        timeline.span(request.name, "NEGOTIATE", request.announced, start)

    def complete_each(
        self, requests: list[Request | None], error: BaseException | None = None
    ) -> None:
        """`complete` each request (None: a joined rank's part) with no result of its own
        (a fused batch): their names leave the in-flight set under one lock."""
        handles, results, errors = [], [], []
        for request in requests:
            if request is not None:
                if error is None and request.finish is None:  # the usual allreduce
                    result, failure = request.result, None
                else:
                    result, failure = self._outcome(request, None, error)
                handles.append(request.handle)
                results.append(result)
                errors.append(failure)
        now = time.perf_counter()
        with self._mutex:
            in_flight = self._in_flight
            for request in requests:
                if request is not None:
                    in_flight.pop(request.name, None)
                    if request.flight is not None:
                        flight.finish(request.flight, request.announced, now, error)
        finish_each(handles, results, errors)

    def complete(
        self, request: Request, result: Any = None, error: BaseException | None = None
    ) -> None:
        result, error = self._outcome(request, result, error)
        with self._mutex:
            self._in_flight.pop(request.name, None)
        flight.finish(request.flight, request.announced, time.perf_counter(), error)
        request.handle._finish(result, error)

    @staticmethod
    def _outcome(
        request: Request, result: Any, error: BaseException | None
    ) -> tuple[Any, BaseException | None]:
        """What the caller gets: the request's `finish` of the raw result (or, with neither,
        its `result`), or its error."""
        if error is None:
            if request.finish is not None:
                try:
                    return request.finish(result), None
                except Exception as exc:  # noqa: BLE001 - e.g. unpickling a peer's object
                    return None, exc
            if result is None:
                return request.result, None
        return result, error

    # ------------------------------------------------------------------ stalls, join, end
    def _finish_join(self, last: int) -> None:
        with self._lock:
            handle, self._join_handle = self._join_handle, None
            self._joined_cycle = 0
        if handle is not None:
            handle._finish(last)
            wake_waiters()

    def _shut_down(self, by: int) -> None:
        if by == self.rank:
            self.fail_everything(
                RingplugError(
                    "ringplug was shut down (by this rank) before this collective ran on every "
                    "rank."
                )
            )
            return
        by = self.ranks[by] if self.ranks is not None else by  # as the world names it
        waiting = sorted(self.pending)
        what = (
            f" while this rank waited in {', '.join(repr(n) for n in waiting[:5])}"
            if waiting
            else ""
        )
        self.fail_everything(
            PeerLeftError(
                f"rank {by} left the job{what}: it ended ringplug (its program ended, or called "
                "ringplug.shutdown()) before every rank was done with the collectives they share. "
                "Every rank must run the same collectives; look at why rank "
                f"{by} stopped early (an exception caught and ended with sys.exit, fewer batches).",
                caused_by=(by,),
            )
        )

    def report_where(self, reason: str, stacks: bool = False) -> None:
        """Write this rank's flight record (and, with `stacks`, its threads' stacks) for a
        stall report: as ringrun events, else to a file and stderr (`forensics`)."""
        announced = {name: r.announced for name, r in list(self.pending.items())}
        records = self.flight.records(_kind_and_bytes, announced)
        host = socket.gethostname()
        written = time.time()
        sent = log.event(
            wire.FLIGHT,
            rank=self.world_rank,
            host=host,
            reason=reason,
            written=written,
            records=records,
        )
        if not sent and records:
            path = flight.write_own(self.world_rank, host, reason, records)
            logger.error("flight record of rank %d (%s): %s", self.world_rank, reason, path)
        if stacks:
            report = own_stacks()
            if not log.event(
                wire.STACKS, rank=self.world_rank, host=host, reason=reason, report=report.to_dict()
            ):
                log.say(
                    self.world_rank,
                    report_lines(
                        f"stacks of rank {self.world_rank} on host {host} ({reason})", report
                    ),
                )

    def _last_words(self, message: str) -> None:
        """Before `log.end_job` ends this rank: its flight record, once."""
        if not self._flight_written:
            self._flight_written = True
            self.report_where(message[:300])

    def in_flight_names(self) -> list[str]:
        """The names of this rank's collectives submitted and not complete, sorted."""
        with self._mutex:
            return sorted(self._in_flight)

    @property
    def failure(self) -> BaseException | None:
        """What ended this engine for good (every later call raises it), or ``None``."""
        return self._failure

    @property
    def traffic(self) -> Traffic:
        """What this rank's engine has sent (messages and bytes by purpose, MPI collectives
        called), for tests and benchmarks."""
        return self.waiter.traffic

    def fail_everything(self, error: BaseException) -> None:
        if self._in_flight and self.size > 1:  # a lone process has no one to part from
            self._last_words(f"{type(error).__name__}: {error}")
        with self._lock:
            self._failure = error
            handles = [r.handle for r in self.pending.values()] + [r.handle for r in self._queue]
            # ... and those no longer pending but not complete: a batch the failing cycle
            # was running, a request-less call's adopted request.
            handles += [h for h in self._in_flight.values() if h is not None]
            self._queue.clear()
            self.pending.clear()
            self._in_flight.clear()
            join, self._join_handle = self._join_handle, None
        for handle in dict.fromkeys(handles):
            if not handle._done:
                handle._finish(None, error)
        if join is not None:
            join._finish(None, error)
        wake_waiters()


def eager_threshold(settings: Settings, size: int) -> int:
    """The bytes of small allreduces a negotiation message may carry on `size` ranks: only
    where the messages are gathered every cycle (`exchange.gathers_only`, up to 7 ranks);
    beyond, a small allreduce is a collective of its own."""
    if size < 2 or not gathers_only(size):
        return 0
    return settings.eager_threshold


def _mismatch_error(request: Request, message: str) -> BaseException:
    if request.error is not None:
        return request.error
    if "rejected their arguments" in message:
        return PeerArgumentError(message)
    return MismatchError(message)


def _kind_and_bytes(signature: Any) -> tuple[str, int]:
    """A flight record's kind and size of a request (an express call records them itself)."""
    if isinstance(signature[0], str):
        return signature
    elements = math.prod(signature.shape) if signature.shape else 1
    size = ITEMSIZE[signature.code] if 0 <= signature.code < len(ITEMSIZE) else 0
    return signature.kind.label, elements * size
