"""The engine: negotiates, fuses and runs the collectives of one process.

Callers (the user's thread, autograd hooks, a Keras step) submit requests and get a
`Handle`. The engine is three small objects and itself:

    caller ──submit──▶ Scheduler ──turn──▶ Cycle.run: take ─▶ negotiate ─▶ plan ─▶ run
                       (scheduler.py)       (cycle.py)        │ fast path: a lone request
                       who runs the next                      │ of an agreed form, the same
                       cycle: the caller                      │ form from every rank: the
                       that waits, or the                     │ plan is that request
                       engine thread                          └ else: decode, `decide`

- `Scheduler` (`scheduler.py`): admits submissions and decides who runs the next cycle:
  a caller waiting for its own synchronous collective runs it on its thread when the
  engine is free, otherwise the engine thread does. Its `turn` is held by the one thread
  talking to MPI.
- `Cycle` (`cycle.py`): the one cycle, negotiate, plan, run, with its state (cycle number,
  pending requests, the cache of agreed requests, this cycle's carried data and settings).
- `Counters` (`counters.py`): cycles and collectives run, for tests and benchmarks.
- `Engine` (here): what the kinds see (`kinds.kind.EngineView`: the transport, the GPU
  plane, completing requests, failing a collective so that every rank hears of it), and
  what lasts the engine's life: its communicators and deadlines (`Waiter`), the timeline,
  the stall inspector, the flight record, join, stop and failure.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ... import wire
from ...config import Settings
from ...forensics import flight
from ...forensics.flight import FlightRecorder
from ...forensics.stacks import own_stacks, report_lines
from ...wire import UNNAMED, Response
from .. import autotune, log
from ..algorithms import ALLREDUCE, CANDIDATES, HIERARCHICAL, AlgorithmTable, Band
from ..dtypes import ITEMSIZE
from ..errors import (
    CommunicatorFailed,
    PeerEngineFailedError,
    PeerFailedError,
    PeerLeftError,
    RingplugError,
)
from ..timeline import Timeline
from ..transport.host import Transport
from ..transport.traffic import Traffic
from ..transport.waiting import Waiter, peer_failed_error
from .counters import Counters
from .cycle import Cycle
from .exchange import Exchange, gathers_only
from .handles import Handle, Request, finish_each, wake_waiters
from .scheduler import Scheduler
from .stalls import StallInspector

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..gpu.plane import GpuPlane

__all__ = ["Engine", "Handle", "Request"]

logger = logging.getLogger(__name__)


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Engine:
    """Negotiates, fuses and runs the collectives of one process (see the module).

    Args:
        comm: the communicator of the engine's ranks (None: a lone process without MPI).
        settings: read once per cycle (`Cycle.run`): replace it to change the fusion
            threshold or the cycle time from the next cycle on.
        local_rank: this process's rank on its host (its GPU).
        local_size: the ranks on this host (whether each has a core to spin on).
        ranks: for a process set's engine (`comm` holds its members only), the world's rank
            of each member, by which its errors, stall reports and records name them.
        thread_name: the engine thread's name.
    """

    def __init__(
        self,
        comm: MPI.Comm | None,
        settings: Settings,
        local_rank: int = 0,
        local_size: int = 1,
        ranks: tuple[int, ...] | None = None,
        thread_name: str = "ringplug-engine",
    ) -> None:
        self.settings = settings
        self.ranks = ranks
        self.local_rank = local_rank
        self.transport = Transport(comm, settings)
        self.rank, self.size = self.transport.rank, self.transport.size
        self.world_rank = ranks[self.rank] if ranks is not None else self.rank
        # The process sets' engines, which write to this engine's timeline (`process_sets`).
        self.followers: list[Engine] = []
        self._scope_text = ""  # see `scope_text`
        self.ctrl = comm.Dup() if comm is not None else None  # the negotiation's communicator
        # Every wait of this engine (negotiation, ring, MPI collectives) has its deadline.
        self.waiter = Waiter(self.ctrl, settings, self.rank, self.size, ranks)
        self.transport.waiter = self.waiter
        self.exchange = Exchange(self.ctrl, self.waiter, self.rank, self.size)
        if local_size <= _cores():
            self.waiter.spin_with_a_core_each()
        # This rank ended ringplug while peers still waited for it, or its engine or a peer's
        # ended for good: MPI_Finalize would wait for ranks that never come (see runtime).
        self.left_early = False
        # What the kinds keep per engine, by kind label (allreduce: its fusion buffer).
        self.kind_state: dict[str, Any] = {}
        self.stalls = StallInspector(settings, self.rank, self.size, ranks)
        # The last collectives of this rank, for stall reports (`forensics.flight`); written
        # once after a failure (`_last_words`).
        self.flight = FlightRecorder(settings.flight_record)
        self._flight_written = False
        log.before_end.append(self._last_words)
        # The timeline being recorded (rank 0 only); framework adapters add their tracks.
        self.timeline: Timeline | None = None
        self.counters = Counters()
        self._gpu: GpuPlane | None = None  # made at the first GPU collective
        # The numbers of unnamed requests ("noname.N"): `next` of a count is one C call,
        # atomic, without a lock or a Python frame (a synchronous call draws one each).
        self.unnamed_numbers = itertools.count(1)
        self.cycle = Cycle(self, eager_threshold(settings, self.size))
        # For the kinds (`EngineView`): the cycle's own dictionaries, never replaced.
        self.pending = self.cycle.pending  # requests negotiated and not yet run
        self.carried_copies = self.cycle.carried_copies  # this cycle's carried data
        self.scheduler = Scheduler(self, self.cycle.run, thread_name)
        if settings.timeline:
            self.start_timeline(settings.timeline)
        # The allreduce bands autotune applied (none: the table's) and the table before them.
        self.tuned_bands: tuple[Band, ...] = ()
        self._untuned_table: AlgorithmTable | None = None
        # RINGPLUG_AUTOTUNE: the world's engine tells its tuner each cycle's plan
        # (`Cycle.run_plan`), and the tuner changes the settings (`apply_tuned_setting`).
        self.tuner = autotune.for_engine(self) if settings.autotune and ranks is None else None
        self.scheduler.start()

    # ------------------------------------------------------------------ callers' side
    def unnamed(self) -> str:
        """A name for an unnamed request: "noname.1", "noname.2", ... in call order (the
        same sequence on every rank, restarting with each init())."""
        return f"{UNNAMED}{next(self.unnamed_numbers)}"

    def follow_unnamed(self, names: Iterable[str]) -> None:
        """A joined rank takes part in the others' unnamed requests without calling them:
        move its numbering past theirs, so that its calls after join() match theirs."""
        highest = 0
        pending = self.cycle.pending
        for name in names:
            if name.startswith(UNNAMED) and name not in pending:
                number = name[len(UNNAMED) :]
                if number.isdigit():
                    highest = max(highest, int(number))
        if highest:
            # A joined rank submits nothing until its join returns: no `next` races this.
            following = next(self.unnamed_numbers)
            self.unnamed_numbers = itertools.count(max(following, highest + 1))

    def join(self) -> Handle:
        """Declare that this rank has no more data; see `ringplug.join`."""
        scheduler = self.scheduler
        with scheduler.lock:
            if scheduler.failure is not None:
                raise scheduler.failure
            if scheduler.join_handle is not None:
                raise ValueError("join() is already in progress on this rank.")
            scheduler.join_handle = Handle("join")
            scheduler.ring()
            return scheduler.join_handle

    def stop(self, timeout: float = 60.0) -> None:
        """Shut the engine down on every rank, finishing what already ran. Idempotent."""
        scheduler = self.scheduler
        with scheduler.lock:
            scheduler.stop_requested = True
            scheduler.ring()
        if threading.current_thread() is not scheduler.thread:
            scheduler.thread.join(timeout)
        if scheduler.thread.is_alive():
            logger.error("the ringplug engine thread did not stop within %.0f s", timeout)
            return
        if self._last_words in log.before_end:
            log.before_end.remove(self._last_words)
        self.stop_timeline()
        if self.tuner is not None:
            self.tuner.close()
        if self._gpu is not None:
            self._gpu.close()
        if self.ctrl is not None:
            self.ctrl.Free()
            self.ctrl = None
        self.transport.free()

    def start_timeline(self, path: str) -> None:
        """Record a timeline to `path` (rank 0 writes; other ranks ignore the call)."""
        if self.rank != 0:
            return
        with self.scheduler.lock:
            if self.timeline is not None:
                self.timeline.stop()
            self.timeline = Timeline(path, self.rank)
            for follower in self.followers:
                follower.timeline = self.timeline

    def stop_timeline(self) -> None:
        with self.scheduler.lock:
            for follower in self.followers:
                follower.timeline = None
            if self.timeline is not None:
                self.timeline.stop()
                self.timeline = None

    # ------------------------------------------------------------------ what kinds see
    @property
    def collectives_run(self) -> int:
        """Collectives run so far (a fused batch counts once), see `Counters`."""
        return self.counters.collectives_run

    @property
    def scope_text(self) -> str:
        """What this engine's mismatch errors and stall reports add: which process set
        (empty for the world)."""
        return self._scope_text

    @scope_text.setter
    def scope_text(self, text: str) -> None:
        self._scope_text = text
        self.stalls.scope_text = text

    def apply_tuned_setting(
        self, fusion_threshold: int, cycle_time: float, bands: tuple[Band, ...] = ()
    ) -> None:
        """Make the autotuner's setting this engine's from the next cycle on (every rank
        calls it at the end of the same cycle with the same setting; the next `Cycle.run`
        reads the settings): the fusion threshold (bytes), the cycle time (seconds) and the
        host allreduce's bands (`core.algorithms.Band`, each laid over the algorithm table
        as it was before autotune, in order; none: the table as it was).

        Raises:
            ValueError: a band the table refuses (`AlgorithmTable.overriding`), before
                anything changes.
        """
        bands = tuple(bands)
        table = None
        if bands != self.tuned_bands:
            # The table as it was before any tuned band (made collectively at the first
            # collective that chose one; here, if not yet, at this cycle on every rank).
            if self._untuned_table is None:
                self._untuned_table = self.transport.algorithms
            table = self._untuned_table.overriding(*bands)
        self.settings = dataclasses.replace(
            self.settings, fusion_threshold=fusion_threshold, cycle_time=cycle_time
        )
        if self._gpu is not None:
            self._gpu.settings = self.settings
        if table is not None:
            self.transport.use_algorithms(table)
            self.tuned_bands = bands

    def tunable_algorithms(self) -> tuple[tuple[str, ...], AlgorithmTable | None]:
        """What autotune may try for the host allreduce (every rank calls it at the same
        cycle; collective the first time): the algorithms of the table's allreduce row,
        the hierarchical one only where the ranks span hosts (`Transport.spans_hosts`),
        and the table they are tried in (as it is without autotune's bands). None where
        ``RINGPLUG_ALGORITHM`` forces the allreduce, on one rank, or once a GPU collective
        ran (NCCL's allreduce is not the table's)."""
        if self.size == 1 or ALLREDUCE in self.transport.forced or not self.scheduler.host_only:
            return (), None
        table = self._untuned_table or self.transport.algorithms
        names = tuple(
            name
            for name in CANDIDATES[(ALLREDUCE, True)]
            if name != HIERARCHICAL or self.transport.spans_hosts()
        )
        return names, table

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
        cycle = self.cycle
        self.waiter.begin(cycle.number, cycle.position, what)
        cycle.position += 1
        cause = cycle.failed_here
        if cause is None:
            # A peer that failed this collective before this rank got here may have said so
            # already: do not start what it will never take part in.
            notice = self.waiter.peer_failure()
            if notice is None:
                return None
            if notice.final:  # so is every later one; the next negotiation ends the engine
                return peer_failed_error(notice, what)
            cause = peer_failed_error(notice, notice.what)  # "rank r failed X: text"
            cycle.failed_here, cycle.renew = cause, True
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
        self.cycle.renew = True  # its operations may still be posted: leave the communicator
        self.cycle.failed_here = cause
        self.complete_each(requests, error=exc)

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
        with self.scheduler.lock:
            in_flight = self.scheduler.in_flight
            for request in requests:
                if request is not None:
                    in_flight.pop(request.name, None)
                    if request.flight is not None:
                        flight.finish(request.flight, request.announced, now, error)
        finish_each(handles, results, errors)

    def complete(
        self, request: Request, result: Any = None, error: BaseException | None = None
    ) -> None:
        if error is None and result is None and request.finish is None:
            result = request.result  # the usual allreduce: its output array
        else:
            result, error = self._outcome(request, result, error)
        # One dictionary operation, atomic: `Scheduler.submit` holds its lock only to check
        # a name and add it as one step.
        self.scheduler.in_flight.pop(request.name, None)
        if request.flight is not None:
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
    def finish_join(self, last: int) -> None:
        """Every rank has joined: the join's handle gets the last rank to join."""
        with self.scheduler.lock:
            handle, self.scheduler.join_handle = self.scheduler.join_handle, None
            self.cycle.joined_cycle = 0
        if handle is not None:
            handle._finish(last)
            wake_waiters()

    def shut_down(self, by: int) -> None:
        """The ranks agreed to stop, asked by rank `by`: fail what is still in flight."""
        if by == self.rank:
            self.fail_everything(
                RingplugError(
                    "ringplug was shut down (by this rank) before this collective ran on every "
                    "rank."
                )
            )
            return
        by = self.ranks[by] if self.ranks is not None else by  # as the world names it
        waiting = sorted(self.cycle.pending)
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
        announced = {name: r.announced for name, r in list(self.cycle.pending.items())}
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
        with self.scheduler.lock:
            return sorted(self.scheduler.in_flight)

    @property
    def failure(self) -> BaseException | None:
        """What ended this engine for good (every later call raises it), or ``None``."""
        return self.scheduler.failure

    @property
    def traffic(self) -> Traffic:
        """What this rank's engine has sent (messages and bytes by purpose, MPI collectives
        called), for tests and benchmarks."""
        return self.waiter.traffic

    def fail_everything(self, error: BaseException) -> None:
        """End the engine for good with `error`: every handle in flight fails with it, and
        so does every later call."""
        scheduler, cycle = self.scheduler, self.cycle
        if scheduler.in_flight and self.size > 1:  # a lone process has no one to part from
            self._last_words(f"{type(error).__name__}: {error}")
        with scheduler.lock:
            scheduler.failure = error
            handles = [r.handle for r in cycle.pending.values()]
            handles += [r.handle for r in scheduler.queue]
            # ... and those no longer pending but not complete: a batch the failing cycle
            # was running.
            handles += list(scheduler.in_flight.values())
            scheduler.queue.clear()
            cycle.pending.clear()
            scheduler.in_flight.clear()
            join, scheduler.join_handle = scheduler.join_handle, None
        for handle in dict.fromkeys(handles):
            if not handle._done:
                handle._finish(None, error)
        if join is not None:
            join._finish(None, error)
        wake_waiters()

    def cycle_failed(self, exc: BaseException) -> None:
        """A cycle raised `exc`: fail everything in flight with it (or with what it says)
        and end the engine; re-raise what is not an Exception (KeyboardInterrupt)."""
        self.scheduler.ended = True
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

    def thread_failed(self, exc: BaseException, turn: threading.Lock) -> None:
        """The engine thread failed outside a cycle: tell the peers when no caller runs a
        cycle (else they learn at their deadline), and fail everything."""
        logger.exception("the ringplug engine failed")
        if turn.acquire(blocking=False):
            try:
                self._tell_peers_it_ended(exc)
            finally:
                turn.release()
        self.fail_everything(RingplugError(f"the ringplug engine failed: {exc}"))

    def _tell_peers_it_ended(self, exc: BaseException) -> None:
        """Send every peer a final notice (the caller holds the turn): their waits fail at
        once with this text instead of naming this rank as frozen at the timeout."""
        self.left_early = True  # the peers stop too, without MPI_Finalize
        try:
            self.waiter.announce_end(f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - MPI itself may be what failed
            logger.warning("could not tell the other ranks that this engine failed", exc_info=True)


def eager_threshold(settings: Settings, size: int) -> int:
    """The bytes of small allreduces a negotiation message may carry on `size` ranks: only
    where the messages are gathered every cycle (`exchange.gathers_only`, up to 7 ranks);
    beyond, a small allreduce is a collective of its own."""
    if size < 2 or not gathers_only(size):
        return 0
    return settings.eager_threshold


def _kind_and_bytes(signature: Any) -> tuple[str, int]:
    """A flight record's kind and size of a request (an express call records them itself)."""
    if isinstance(signature[0], str):
        return signature
    elements = math.prod(signature.shape) if signature.shape else 1
    size = ITEMSIZE[signature.code] if 0 <= signature.code < len(ITEMSIZE) else 0
    return signature.kind.label, elements * size
