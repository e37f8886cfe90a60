"""The engine: one background thread per process that runs every collective.

Callers (the user's thread, autograd hooks, a Keras step) submit requests and get a
`Handle`; they keep computing while the engine thread, the only thread that talks to MPI,
works in cycles:

1. take what was submitted since the last cycle;
2. negotiate: send every other rank one message with what is ready here (a bit vector
   for requests agreed before, name and signature for new ones) and receive theirs;
   `negotiation.decide` turns the messages into the same plan on every rank;
3. run the plan: allreduces of the same dtype and op are packed into one persistent
   fusion buffer (up to `RINGPLUG_FUSION_THRESHOLD` bytes) and reduced in one pass; a
   group of tensors that already lie side by side in one buffer is reduced where it lies;
4. complete the handles, record the timeline, and check for stalls.

An idle engine sleeps on a condition variable and polls for peers' messages with a
growing interval (at most 1 ms), so a waiting rank uses almost no CPU; a peer's message
or a local submission wakes it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import activity, log, reduce, ring
from .config import Settings
from .dtypes import DType
from .errors import (
    CommunicatorFailed,
    MismatchError,
    PeerArgumentError,
    PeerFailedError,
    PeerLeftError,
    RingplugError,
    StallError,
)
from .negotiation import GPU, Cache, Kind, Message, Plan, Response, Signature, decide
from .ops import ReduceOp
from .timeline import Timeline
from .transport import Transport
from .waiting import IDLE_SLEEP_SECONDS, Waiter, next_delay

if TYPE_CHECKING:
    from mpi4py import MPI

    from .gpu import GpuPlane

logger = logging.getLogger(__name__)

_CONTROL_TAG = 7100
# After a cycle, the next submission or a peer's next message is usually well under a
# millisecond away; poll (yielding the GIL and the core) that long before sleeping.
_POLL_AFTER_CYCLE_SECONDS = 1e-3
_CACHE_CAPACITY = 4096
_UNNAMED = "noname."


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cacheable_name(name: str) -> bool:
    """Whether the negotiation cache may learn a request of this name: given names, but not
    numbered ones ("torch.default#12", used once). Decided from the name alone, so that a
    joined rank, which sees only the names, learns the same slots as the others."""
    return not name.startswith(_UNNAMED) and "#" not in name


# One signal for every handle of the process: the engine notifies it once per cycle
# instead of waking one event per tensor.
_completed = threading.Condition()
_callbacks_lock = threading.Lock()


class Handle:
    """A collective in flight. `wait()` returns its result or raises its error.

    Every rank gets the same outcome: the result, or the same error naming the ranks
    involved.
    """

    __slots__ = ("name", "_done", "_result", "_error", "_callbacks")

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] | None = None

    def done(self) -> bool:
        """Whether the collective has finished (successfully or not); never blocks."""
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective finished; return its result or raise its error."""
        if not self._done:
            with _completed:
                if not _completed.wait_for(lambda: self._done, timeout):
                    raise TimeoutError(
                        f"collective {self.name!r} did not finish within {timeout} s"
                    )
        if self._error is not None:
            raise self._error
        return self._result

    synchronize = wait

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call `callback(handle)` once the collective has finished (at once if it has).

        Callbacks run on the engine thread: they must be quick and must not wait for
        another collective (hand the work to a thread of your own).
        """
        with _callbacks_lock:
            if not self._done:
                self._callbacks = [*(self._callbacks or ()), callback]
                return
        callback(self)

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome; waiters wake at the engine's next `_wake_waiters()`."""
        self._result, self._error = result, error
        with _callbacks_lock:
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - one caller's callback must not stop the engine
                logger.exception("a callback of collective %r failed", self.name)


def _wake_waiters() -> None:
    with _completed:
        _completed.notify_all()


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One collective submitted on this rank.

    An allreduce carries its tensors as flat contiguous arrays in their storage type:
    `sends[i]` is reduced into `outs[i]` (the same memory when in place). A grouped
    allreduce has several.
    """

    name: str
    signature: Signature
    handle: Handle
    cacheable: bool = False
    extra: int = 0  # first dimension (allgather, alltoall) or byte length (objects)
    send: np.ndarray | None = None  # contiguous input, storage type
    out: np.ndarray | None = None  # contiguous output, storage type (broadcast)
    sends: list[np.ndarray] = dataclasses.field(default_factory=list)  # allreduce inputs
    outs: list[np.ndarray] = dataclasses.field(default_factory=list)  # allreduce outputs
    in_place: bool = False  # outs are sends (the same memory)
    span: np.ndarray | None = None  # one flat array whose consecutive views are the outs
    prescale: float = 1.0
    postscale: float = 1.0
    splits: np.ndarray | None = None  # alltoall rows per destination
    data: bytes = b""  # pickled object
    # GPU requests (signature.place == GPU) hold DeviceBuffers where host ones hold arrays,
    # and the event after which the caller's stream has produced the inputs (or None).
    ready: Any = None
    error: BaseException | None = None  # Kind.ERROR: what this rank rejected
    finish: Callable[[Any], Any] | None = None  # turns the raw result into the user's
    submitted: float = 0.0
    announced: float = 0.0


class Engine:
    """Negotiates, fuses and runs the collectives of one process, on its own thread."""

    def __init__(self, comm: MPI.Comm | None, settings: Settings, local_rank: int = 0,
                 local_size: int = 1) -> None:  # fmt: skip
        self.settings = settings
        self.local_rank = local_rank
        self._gpu: GpuPlane | None = None  # made at the first GPU collective
        self.transport = Transport(comm, settings)
        self.rank, self.size = self.transport.rank, self.transport.size
        self._ctrl = comm.Dup() if comm is not None else None
        # Every wait of this engine (negotiation, ring, MPI collectives) has its deadline.
        self.waiter = Waiter(self._ctrl, settings, self.rank, self.size)
        self.transport.waiter = self.waiter
        if local_size <= _cores():
            self.waiter.spin_with_a_core_each()
        self._renew = False  # a collective was abandoned: renew the data communicator
        self.left_early = False  # this rank ended ringplug while peers still waited for it
        self._peers = [(self.rank + d) % self.size for d in range(1, self.size)]
        self._lock = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._in_flight: set[str] = set()
        self._pending: dict[str, Request] = {}  # engine thread only
        self._cache = Cache(_CACHE_CAPACITY)
        self._cycle = 0
        self._fusion = np.empty(0, np.uint8)
        self._failure: BaseException | None = None
        self._failed_here: PeerFailedError | None = None  # a collective of this cycle failed
        self._position = 0  # of the next collective in this cycle's plan
        self._stop_requested = False
        self._joined_cycle = 0
        self._join_handle: Handle | None = None
        self._unnamed_next = 1  # the number of the next unnamed request ("noname.N")
        self._partial_since: dict[str, float] = {}
        self._stall_warned: set[str] = set()
        self._stall_abort: list[str] = []
        self._activities: list[tuple[str, float]] = []  # every rank's, from the last cycle
        self._timeline: Timeline | None = None
        self._timeline_lock = threading.Lock()
        self.cycles_run = 0
        self._last_activity = time.perf_counter()  # end of the last cycle that ran something
        self.collectives_run = 0  # fused batches count once (tests count them)
        if settings.timeline:
            self.start_timeline(settings.timeline)
        self._thread = threading.Thread(target=self._main, name="ringplug-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers' side
    def submit(self, request: Request) -> Handle:
        """Queue `request` for the engine thread; raise at once if it cannot be queued."""
        with self._lock:
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
            self._in_flight.add(request.name)
            request.submitted = time.perf_counter()
            self._queue.append(request)
            self._lock.notify()
        return request.handle

    def unnamed(self) -> str:
        """A name for an unnamed request: "noname.1", "noname.2", ... in call order (the
        same sequence on every rank, restarting with each init())."""
        with self._lock:
            number, self._unnamed_next = self._unnamed_next, self._unnamed_next + 1
        return f"{_UNNAMED}{number}"

    def _follow_unnamed(self, names: Iterable[str]) -> None:
        """A joined rank takes part in the others' unnamed requests without calling them:
        move its numbering past theirs, so that its calls after join() match theirs."""
        highest = 0
        for name in names:
            if name.startswith(_UNNAMED) and name not in self._pending:
                number = name[len(_UNNAMED) :]
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
            self._lock.notify()
            return self._join_handle

    def stop(self, timeout: float = 60.0) -> None:
        """Shut the engine down on every rank, finishing what already ran. Idempotent."""
        with self._lock:
            self._stop_requested = True
            self._lock.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the ringplug engine thread did not stop within %.0f s", timeout)
            return
        self.stop_timeline()
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
            if self._timeline is not None:
                self._timeline.stop()
            self._timeline = Timeline(path, self.rank)

    @property
    def timeline(self) -> Timeline | None:
        """The timeline being recorded (rank 0 only), for framework adapters' own tracks."""
        return self._timeline

    def stop_timeline(self) -> None:
        with self._timeline_lock:
            if self._timeline is not None:
                self._timeline.stop()
                self._timeline = None

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            while True:
                if not self._wait_for_work():
                    continue
                if self._run_cycle():
                    break
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear about it
            if isinstance(exc, CommunicatorFailed):
                logger.error("%s", exc)
                self._fail_everything(exc)
                return
            logger.exception("the ringplug engine failed")
            self._fail_everything(RingplugError(f"the ringplug engine failed: {exc}"))

    def _wait_for_work(self) -> bool:
        """Sleep until there is a reason to run a cycle; False to look again."""
        delay = 20e-6
        retry_at = time.monotonic() + self._idle_cycle_period()
        # Right after a cycle the next request or a peer's message is usually microseconds
        # away: poll, yielding the GIL, before sleeping (a sleep costs 60+ us to wake from).
        # With nothing of ours in flight there is nothing to answer quickly: a local request
        # wakes the engine at once, and peers wait for that request anyway. Then the engine
        # sleeps 1 ms at a time, leaving the core to the training thread (polling every
        # 200 us through the forward pass cost 20% of its speed on a 1-core rank).
        in_flight = bool(self._pending) or self._join_handle is not None
        spin_until = time.perf_counter() + (_POLL_AFTER_CYCLE_SECONDS if in_flight else 0.0)
        if not in_flight:
            delay = IDLE_SLEEP_SECONDS
        while True:
            with self._lock:
                if self._queue or self._stop_requested:
                    return True
                if self._join_handle is not None and not self._joined_cycle:
                    return True
            if self._ctrl is not None and self._ctrl.Iprobe(tag=_CONTROL_TAG):
                return True  # a peer started a cycle
            if (self._pending or self._joined_cycle) and time.monotonic() >= retry_at:
                return True  # look again, for the stall inspector
            if self.size == 1 and not self._pending:
                with self._lock:
                    if not (self._queue or self._stop_requested or self._join_handle):
                        self._lock.wait(0.05)
                return False
            if time.perf_counter() < spin_until:
                time.sleep(0)
                continue
            with self._lock:
                if not (self._queue or self._stop_requested):
                    self._lock.wait(delay)
            if in_flight:
                delay = next_delay(delay, self._last_activity)

    def _idle_cycle_period(self) -> float:
        settings = self.settings
        return min(max(min(settings.stall_check_seconds, settings.timeout) / 4, 0.05), 1.0)

    def _run_cycle(self) -> bool:
        """One negotiation and its plan; True when the engine should stop."""
        cycle_start = time.perf_counter()
        if self.settings.cycle_time > 0:
            time.sleep(self.settings.cycle_time)  # let more requests gather for fusion
        with self._lock:
            fresh = list(self._queue)
            self._queue.clear()
            stopping = self._stop_requested
            if self._join_handle is not None and not self._joined_cycle:
                self._joined_cycle = self._cycle + 1
        for request in fresh:
            request.announced = cycle_start
            self._pending[request.name] = request
        self._cycle += 1
        own = self._message(stopping)
        messages = self._exchange(own)
        self._activities = [m.activity for m in messages]  # for the stall reports
        plan = decide(messages, self._cache)
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
        cacheable = {n for n, r in self._pending.items() if r.cacheable}
        # A joined rank lacks the others' requests; it must still learn the same slots
        # (given names are the cacheable ones), or its cache parts from theirs.
        cacheable.update(
            r.name for r in plan.responses if r.name not in self._pending and cacheable_name(r.name)
        )
        self._cache.learn(plan, cacheable)
        self._execute(plan)
        self._inspect_stalls(plan)
        if plan.all_joined:
            self._finish_join(plan.last_joined)
        _wake_waiters()
        if plan.responses or plan.errors:
            self._last_activity = time.perf_counter()
        timeline = self._timeline
        if timeline is not None:
            timeline.marker(f"cycle {self._cycle}", cycle_start, ran=len(plan.responses))
            timeline.flush()
        return False

    def _message(self, stopping: bool) -> Message:
        message = Message(self._cycle, joined_cycle=self._joined_cycle, shutdown=stopping)
        message.renew, self._renew = self._renew, False
        message.activity = activity.current()
        for name, request in self._pending.items():
            slot = self._cache.slot_for(name, request.signature) if request.cacheable else None
            if slot is not None:
                message.cached |= 1 << slot
            else:
                message.new.append((name, request.signature, request.extra))
        if self._stall_abort:
            message.stall_abort, self._stall_abort = self._stall_abort, []
        return message

    def _exchange(self, own: Message) -> list[Message]:
        """Send `own` to every peer and receive theirs (this cycle's, in rank order)."""
        messages: list[Message | None] = [None] * self.size
        messages[self.rank] = own
        if self.size == 1:
            return messages  # type: ignore[return-value]
        from mpi4py import MPI

        ctrl = self._ctrl
        payload = bytearray(pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL))
        sends = [ctrl.Isend([payload, MPI.BYTE], peer, _CONTROL_TAG) for peer in self._peers]
        waiting = list(self._peers)
        status = MPI.Status()

        def arrived() -> bool:
            for peer in list(waiting):
                if ctrl.Iprobe(source=peer, tag=_CONTROL_TAG, status=status):
                    buffer = bytearray(status.Get_count(MPI.BYTE))
                    ctrl.Recv([buffer, MPI.BYTE], peer, _CONTROL_TAG)
                    messages[peer] = pickle.loads(buffer)
                    waiting.remove(peer)
            return not waiting

        pending = sorted(self._pending)
        shown = ", ".join(repr(n) for n in pending[:5]) + (", ..." if len(pending) > 5 else "")
        self.waiter.begin(self._cycle, -1, "negotiation")
        # A rank that sent its message is alive: only the others can be the ones missing.
        self.waiter.wait(arrived, f"pending here: {shown or 'nothing of its own'}",
                         missing=lambda: sorted(waiting))  # fmt: skip
        self.waiter.wait_requests(sends, "sending this rank's negotiation message")
        return messages  # type: ignore[return-value]

    # ------------------------------------------------------------------ running a plan
    def _execute(self, plan: Plan) -> None:
        if self._join_handle is not None:
            self._follow_unnamed([r.name for r in plan.responses] + list(plan.errors))
        for name, message in plan.errors.items():
            request = self._pending.pop(name, None)
            if request is not None:
                self._complete(request, error=_mismatch_error(request, message))
        batch: list[Response] = []
        batch_bytes = 0
        self._failed_here = None
        self._position = 0
        for response in plan.responses:
            signature = response.signature
            if signature.kind is Kind.ALLREDUCE:
                nbytes = (
                    int(np.prod(signature.shape, dtype=np.int64)) * DType(signature.code).itemsize
                )
                if batch and (
                    batch[0].signature.code != signature.code
                    or batch[0].signature.op != signature.op
                    or batch[0].signature.place != signature.place
                    or batch_bytes + nbytes > self.settings.fusion_threshold
                ):
                    self._allreduce_batch(batch)
                    batch, batch_bytes = [], 0
                batch.append(response)
                batch_bytes += nbytes
                continue
            if batch:
                self._allreduce_batch(batch)
                batch, batch_bytes = [], 0
            self._run_single(response)
        if batch:
            self._allreduce_batch(batch)

    def _begin(self, kind: str, responses: list[Response]) -> PeerFailedError | None:
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
            cause = PeerFailedError(
                f"rank {notice.rank} failed {notice.what}: {notice.text}", caused_by=(notice.rank,)
            )
            self._failed_here, self._renew = cause, True
            if notice.what == what:
                return cause
        return PeerFailedError(f"{what} did not run: {cause}", caused_by=cause.caused_by)

    def _failed(self, exc: BaseException, requests: list[Request | None]) -> None:
        """A collective failed while running: fail its requests here, and make sure every
        peer hears of it instead of waiting for this rank forever."""
        if isinstance(exc, PeerFailedError):
            cause = exc
        else:
            text = f"{type(exc).__name__}: {exc}"
            logger.error("rank %d failed %s: %s", self.rank, self.waiter.what, text)
            self.waiter.announce_failure(text)
            cause = PeerFailedError(f"rank {self.rank} failed {self.waiter.what}: {text}")
        self._renew = True  # its operations may still be posted: leave the communicator
        self._failed_here = cause
        self._complete_each(requests, error=exc)

    def _allreduce_batch(self, batch: list[Response]) -> None:
        """Reduce the tensors of `batch` (same dtype and op) in one collective.

        Large batches are reduced where the tensors lie (the ring sends several arrays as
        one range); small ones, which MPI's own Allreduce handles best, are packed into the
        fusion buffer first. Tensors that already sit side by side in one buffer are
        reduced there either way.
        """
        code, op = DType(batch[0].signature.code), ReduceOp(batch[0].signature.op)
        requests = [self._pending.pop(r.name, None) for r in batch]
        if batch[0].signature.place == GPU:
            self._gpu_allreduce_batch(batch, requests, code, op)
            return
        skipped = self._begin("allreduce", batch)
        if skipped is not None:
            self._complete_each(requests, error=skipped)
            return
        try:
            self._host_allreduce_batch(batch, requests, code, op)
        except CommunicatorFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or peers hang
            self._failed(exc, requests)

    def _host_allreduce_batch(self, batch: list[Response], requests: list[Request | None],
                              code: DType, op: ReduceOp) -> None:  # fmt: skip
        # One entry per tensor: (request or None for a joined rank, input, output).
        entries: list[tuple[Request | None, np.ndarray, np.ndarray]] = []
        for response, request in zip(batch, requests, strict=True):
            if request is not None:
                entries.extend((request, s, o) for s, o in zip(request.sends, request.outs,
                                                                 strict=True))  # fmt: skip
            else:
                entries.extend((None, part, part) for part in _joined_parts(response, op, code))
        total = sum(send.size for _, send, _ in entries)
        start = time.perf_counter()
        packed = False
        present = [request for request in requests if request is not None]
        span = None
        if len(requests) == 1 and present and present[0].span is not None:
            span = present[0].span  # a grouped allreduce's result buffer
        elif len(present) == len(requests) and all(r.in_place for r in present):
            span = _span([out for _, _, out in entries], code)  # e.g. a gradient buffer
        if span is not None:
            # The outputs lie side by side in one buffer: reduce there, after one copy in
            # unless the tensors are reduced in place.
            target: np.ndarray | ring.Pieces = span
            parts = [out for _, _, out in entries]
            if not all(r.in_place for r in present):
                np.concatenate([send for _, send, _ in entries], out=span)
        elif len(entries) == 1 or self.transport.uses_ring(total * code.itemsize, code, op):
            parts = []
            for request, send, out in entries:
                if request is not None and not request.in_place:
                    np.copyto(out, send)
                parts.append(out)
            target = parts[0] if len(parts) == 1 else ring.Pieces(parts)
        else:
            packed = True
            target = self._fusion_view(code, total)
            np.concatenate([send for _, send, _ in entries], out=target)
            parts = ring.split(target, [send.size for _, send, _ in entries])
        for (request, _, _), part in zip(entries, parts, strict=True):
            if request is not None and request.prescale != 1.0:
                reduce.scale(part, request.prescale, code)
        copied_in = time.perf_counter()
        average = op is ReduceOp.AVERAGE
        factors = {request.postscale / self.size if average else request.postscale
                   for request in present}  # fmt: skip
        # One factor for the whole batch (the usual case) is applied inside the reduction,
        # with no pass of its own over the result.
        shared = factors.pop() if len(factors) == 1 else 1.0
        self.transport.allreduce(target, op, code, postscale=shared)
        reduced = time.perf_counter()
        self.collectives_run += 1
        for (request, _, out), part in zip(entries, parts, strict=True):
            if request is None:
                continue
            if packed:
                out[...] = part
            factor = request.postscale / self.size if average else request.postscale
            if shared == 1.0 and factor != 1.0:
                reduce.scale(out, factor, code)
        copied_out = time.perf_counter()
        self._complete_each(requests)
        timeline = self._timeline
        if timeline is not None:
            for request in requests:
                if request is None:
                    continue
                self._trace_wait(timeline, request, start)
                if copied_in - start > 1e-6:
                    timeline.span(request.name, "COPY_IN", start, copied_in)
                timeline.span(request.name, "ALLREDUCE", copied_in, reduced,
                              fused=len(batch), path=self.transport.last_path)  # fmt: skip
                if packed:
                    timeline.span(request.name, "COPY_OUT", reduced, copied_out)

    def _gpu_plane(self) -> GpuPlane:
        if self._gpu is None:
            from .gpu import GpuPlane  # only GPU jobs load NCCL

            self._gpu = GpuPlane(self.transport, self.settings, self.local_rank)
        return self._gpu

    def _gpu_allreduce_batch(self, batch: list[Response], requests: list[Request | None],
                             code: DType, op: ReduceOp) -> None:  # fmt: skip
        """The GPU form of `_allreduce_batch`: NCCL, with the fusion buffer on the device."""
        items: list[tuple[Any, Any, float, float]] = []
        for response, request in zip(batch, requests, strict=True):
            if request is None:  # joined: identity values from the host
                items.extend((part, None, 1.0, 1.0) for part in _joined_parts(response, op, code))
                continue
            pairs = zip(request.sends, request.outs, strict=True)
            items.extend((send, out, request.prescale, request.postscale) for send, out in pairs)
        start = time.perf_counter()
        try:
            self._gpu_plane().allreduce(items, code, op, [r.ready for r in requests if r])
        except CommunicatorFailed as exc:  # these requests left _pending: fail them here
            self._complete_each(requests, error=exc)
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. out of device memory for the fusion buffer
            # Its callers hear it; peers inside the NCCL collective end at the GPU plane's
            # timeout, which aborts the communicator on every rank.
            self._complete_each(requests, error=exc)
            return
        done = time.perf_counter()
        self.collectives_run += 1
        self._complete_each(requests)
        timeline = self._timeline
        if timeline is not None:
            for request in requests:
                if request is not None:
                    self._trace_wait(timeline, request, start)
                    timeline.span(request.name, "NCCL_ALLREDUCE", start, done, fused=len(batch))

    def _fusion_view(self, code: DType, count: int) -> np.ndarray:
        nbytes = count * code.itemsize
        if self._fusion.nbytes < nbytes:
            # Grows to the largest batch seen (at most the fusion threshold) and is reused.
            self._fusion = np.empty(max(nbytes, min(self.settings.fusion_threshold, 4 * nbytes)),
                                    np.uint8)  # fmt: skip
        return self._fusion[:nbytes].view(code.storage)

    def _run_single(self, response: Response) -> None:
        """Run a collective that is not fused (everything but allreduce)."""
        signature = response.signature
        request = self._pending.pop(response.name, None)
        if signature.kind is Kind.ERROR:  # every rank rejected its arguments: each raises its own
            if request is not None:
                self._complete(request, error=request.error)
            return
        start = time.perf_counter()
        if signature.place != GPU:
            skipped = self._begin(signature.kind.label, [response])
            if skipped is not None:
                self._complete_each([request], error=skipped)
                return
        try:
            if signature.place == GPU:
                result = self._dispatch_gpu(signature, response, request)
            else:
                result = self._dispatch(signature, response, request)
        except CommunicatorFailed as exc:
            if request is not None:
                self._complete(request, error=exc)
            raise  # every other GPU collective must fail too
        except _SameEverywhere as exc:  # raised alike on every rank, before any data moved
            if request is not None:
                self._complete(request, error=exc)
            return
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or peers hang
            if signature.place == GPU:
                if request is not None:
                    self._complete(request, error=exc)
                return
            self._failed(exc, [request])
            return
        self.collectives_run += 1
        if request is not None:
            self._complete(request, result=result)
            timeline = self._timeline
            if timeline is not None:
                self._trace_wait(timeline, request, start)
                timeline.span(request.name, signature.kind.name, start, time.perf_counter())

    def _dispatch(self, signature: Signature, response: Response, request: Request | None) -> Any:
        kind, transport = signature.kind, self.transport
        code = DType(signature.code) if signature.code >= 0 else None
        _check_joined(signature, response)
        if kind is Kind.BARRIER:
            return None
        if kind is Kind.BROADCAST:
            if not response.have[signature.root]:
                raise _SameEverywhere(f"broadcast {response.name!r}: root rank {signature.root} "
                                      "has joined and has nothing to send.")  # fmt: skip
            buf = request.out if request is not None else np.empty(signature.shape, code.storage)
            transport.broadcast(buf, signature.root)
            return buf
        if kind is Kind.ALLGATHER:
            send = (
                request.send
                if request is not None
                else np.empty((0, *signature.shape), code.storage)
            )
            return transport.allgather(send, response.extras)
        if kind is Kind.REDUCESCATTER:
            op = ReduceOp(signature.op)
            send = (
                request.send
                if request is not None
                else np.full(signature.shape, _identity(op, code), code.storage)
            )
            block = transport.reducescatter(send, op, code, request.prescale if request else 1.0)
            if request is not None:
                factor = (
                    request.postscale / self.size if op is ReduceOp.AVERAGE else (request.postscale)
                )
                reduce.scale(block.reshape(-1), factor, code)
            return block
        if kind is Kind.ALLTOALL:
            if not all(response.have):
                raise _SameEverywhere(f"alltoall {response.name!r} cannot run after a rank joined.")
            return transport.alltoall(request.send, request.splits)
        if kind is Kind.BROADCAST_OBJECT:
            if not response.have[signature.root]:
                raise _SameEverywhere(f"broadcast_object {response.name!r}: root rank "
                                      f"{signature.root} has joined.")  # fmt: skip
            length = response.extras[signature.root]
            data = request.data if request is not None else b""
            return transport.broadcast_bytes(data, length, signature.root)
        if kind is Kind.ALLGATHER_OBJECT:
            data = request.data if request is not None else b""
            return transport.allgather_bytes(data, response.extras)
        raise _SameEverywhere(f"unknown collective kind {kind}")

    def _dispatch_gpu(self, signature: Signature, response: Response,
                      request: Request | None) -> Any:  # fmt: skip
        """Broadcast, allgather and reducescatter of device buffers (results stay on the GPU)."""
        _check_joined(signature, response)
        kind, plane = signature.kind, self._gpu_plane()
        code = DType(signature.code)
        ready = request.ready if request is not None else None
        if kind is Kind.BROADCAST:
            if not response.have[signature.root]:
                raise RingplugError(f"broadcast {response.name!r}: root rank {signature.root} "
                                    "has joined and has nothing to send.")  # fmt: skip
            count = int(np.prod(signature.shape, dtype=np.int64))
            return plane.broadcast(request.out if request else None, count, code,
                                   signature.root, ready)  # fmt: skip
        row_elems = int(np.prod(signature.shape[1:] if kind is Kind.REDUCESCATTER
                                else signature.shape, dtype=np.int64))  # fmt: skip
        if kind is Kind.ALLGATHER:
            send, out = (request.send, request.out) if request else (None, None)
            return plane.allgather(send, response.extras, row_elems, code, ready, out)
        if kind is Kind.REDUCESCATTER:
            op = ReduceOp(signature.op)
            count = int(np.prod(signature.shape, dtype=np.int64))
            send = request.send if request else np.full(count, _identity(op, code), code.storage)
            return plane.reducescatter(
                send, signature.shape[0], row_elems, code, op,
                request.prescale if request else 1.0, request.postscale if request else 1.0,
                ready,
            )  # fmt: skip
        raise RingplugError(f"{kind.label} is not available for GPU tensors.")

    @staticmethod
    def _trace_wait(timeline: Timeline, request: Request, start: float) -> None:
        timeline.span(request.name, "QUEUE", request.submitted, request.announced)
        timeline.span(request.name, "NEGOTIATE", request.announced, start)

    def _complete_each(self, requests: list[Request | None],
                       error: BaseException | None = None) -> None:  # fmt: skip
        for request in requests:
            if request is not None:
                self._complete(request, error=error)

    def _complete(
        self, request: Request, result: Any = None, error: BaseException | None = None
    ) -> None:
        if error is None and request.finish is not None:
            try:
                result = request.finish(result)
            except Exception as exc:  # noqa: BLE001 - e.g. unpickling a peer's object
                error = exc
        with self._lock:
            self._in_flight.discard(request.name)
        request.handle._finish(result, error)

    # ------------------------------------------------------------------ stalls, join, end
    def _inspect_stalls(self, plan: Plan) -> None:
        now = time.monotonic()
        for name in list(self._partial_since):
            if name not in plan.partial:
                del self._partial_since[name]
                self._stall_warned.discard(name)
        for name in plan.partial:
            self._partial_since.setdefault(name, now)
        if plan.stall_abort:
            self._fail_everything(StallError(self._stall_text(plan, plan.stall_abort, now)))
            return
        overdue = [n for n, t in self._partial_since.items()
                   if n in self._pending and now - t >= self.settings.timeout]  # fmt: skip
        if overdue:
            name = overdue[0]
            missing = [r for r in range(self.size) if r not in plan.partial[name]]
            kind = self._pending[name].signature.kind.label
            log.end_job(
                self.rank,
                f"rank {self.rank} waited {now - self._partial_since[name]:.0f} s in {kind} "
                f"{name!r} for rank(s) {_ranks(missing)}, which never submitted it "
                f"(RINGPLUG_TIMEOUT={self.settings.timeout:g})"
                f"{_then(activity.describe(missing, self._activities, plan.partial))}. Ending "
                "the job: MPI cannot cancel a collective. Look at what the missing ranks were "
                "doing (a stuck data loader, an uneven number of batches, a branch only some "
                "ranks take).",
                culprits=missing,
            )
        if self.rank != 0:
            return
        check, shutdown = self.settings.stall_check_seconds, self.settings.stall_shutdown_seconds
        late = [n for n, t in self._partial_since.items() if now - t >= check]
        fresh = [n for n in late if n not in self._stall_warned]
        if fresh:
            self._stall_warned.update(fresh)
            logger.warning("%s", self._stall_text(plan, late, now))
        if shutdown > 0:
            doomed = [n for n, t in self._partial_since.items() if now - t >= shutdown]
            if doomed:
                self._stall_abort = doomed  # sent in the next cycle, so every rank fails alike

    def _stall_text(self, plan: Plan, names: list[str], now: float) -> str:
        active = range(self.size)
        parts = []
        for name in sorted(names)[:20]:
            holders = plan.partial.get(name, [])
            missing = [r for r in active if r not in holders]
            waited = now - self._partial_since.get(name, now)
            doing = activity.describe(missing, self._activities, plan.partial)
            parts.append(f"{name!r} is ready on rank(s) {_ranks(holders)} but not on rank(s) "
                         f"{_ranks(missing)} (for {waited:.0f} s{_then(doing)})")  # fmt: skip
        return (
            "Stalled collectives: " + "; ".join(parts) + ". The missing ranks are elsewhere in "
            "the program: a different number of batches, a branch only some ranks take, or "
            "tensors submitted in a different set (RINGPLUG_STALL_CHECK_SECONDS="
            f"{self.settings.stall_check_seconds:g}, RINGPLUG_STALL_SHUTDOWN_SECONDS="
            f"{self.settings.stall_shutdown_seconds:g})."
        )

    def _finish_join(self, last: int) -> None:
        with self._lock:
            handle, self._join_handle = self._join_handle, None
            self._joined_cycle = 0
        if handle is not None:
            handle._finish(last)
            _wake_waiters()

    def _shut_down(self, by: int) -> None:
        if by == self.rank:
            self._fail_everything(RingplugError(
                "ringplug was shut down (by this rank) before this collective ran on every rank."
            ))  # fmt: skip
            return
        waiting = sorted(self._pending)
        what = (
            f" while this rank waited in {', '.join(repr(n) for n in waiting[:5])}"
            if waiting
            else ""
        )
        self._fail_everything(PeerLeftError(
            f"rank {by} left the job{what}: it ended ringplug (its program ended, or called "
            "ringplug.shutdown()) before every rank was done with the collectives they share. "
            "Every rank must run the same collectives; look at why rank "
            f"{by} stopped early (an exception caught and ended with sys.exit, fewer batches).",
            caused_by=(by,),
        ))  # fmt: skip

    def _fail_everything(self, error: BaseException) -> None:
        with self._lock:
            self._failure = error
            requests = list(self._pending.values()) + list(self._queue)
            self._queue.clear()
            self._pending.clear()
            self._in_flight.clear()
            join, self._join_handle = self._join_handle, None
        for request in requests:
            request.handle._finish(None, error)
        if join is not None:
            join._finish(None, error)
        _wake_waiters()


class _SameEverywhere(RingplugError):
    """A collective that cannot run, found from the plan alone: every rank raises it."""


def _span(arrays: list[np.ndarray], code: DType) -> np.ndarray | None:
    """The flat region of one buffer that holds `arrays` side by side in order, or None."""
    if len(arrays) < 2:
        return None
    first = arrays[0]
    base = first.base if first.base is not None else first
    if not isinstance(base, np.ndarray) or not base.flags.c_contiguous:
        return None
    address = first.ctypes.data
    for array in arrays:
        owner = array.base if array.base is not None else array
        if owner is not base or array.ctypes.data != address:
            return None
        address += array.nbytes
    start, misaligned = divmod(first.ctypes.data - base.ctypes.data, code.itemsize)
    if misaligned or base.nbytes % code.itemsize:
        return None
    return base.reshape(-1).view(code.storage)[start : start + sum(a.size for a in arrays)]


def _then(clause: str) -> str:
    return f"; {clause}" if clause else ""


def _ranks(ranks: Any) -> str:
    return ", ".join(map(str, ranks)) or "none"


def _mismatch_error(request: Request, message: str) -> BaseException:
    if request.error is not None:
        return request.error
    if "rejected their arguments" in message:
        return PeerArgumentError(message)
    return MismatchError(message)


def _check_joined(signature: Signature, response: Response) -> None:
    """Fail a request that refuses joined ranks when one has joined (on every rank: they
    all see the same response)."""
    if signature.refuse_joined and not all(response.have):
        joined = ", ".join(str(r) for r, has in enumerate(response.have) if not has)
        raise RingplugError(
            f"{signature.kind.label} {response.name!r} cannot run while rank(s) {joined} have "
            "joined (hvd.join()): only allreduce takes part for a joined rank. Call join() "
            "after the last allgather or broadcast."
        )


def _joined_parts(response: Response, op: ReduceOp, code: DType) -> list[np.ndarray]:
    """What a joined rank contributes to an allreduce: identity values, one flat array per
    tensor of the request."""
    shapes = response.signature.parts or (response.signature.shape,)
    return [np.full(int(np.prod(shape, dtype=np.int64)), _identity(op, code), code.storage)
            for shape in shapes]  # fmt: skip


def _identity(op: ReduceOp, code: DType) -> Any:
    """The value a joined rank contributes, so that it changes nothing."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return 0
    if code is DType.BOOL:
        return op in (ReduceOp.PRODUCT, ReduceOp.MIN)
    if op is ReduceOp.PRODUCT:
        return _BF16_ONE if code is DType.BFLOAT16 else 1
    low = op is ReduceOp.MAX
    if code is DType.BFLOAT16:
        return _BF16_MINUS_INF if low else _BF16_INF
    if code.is_floating:
        return -np.inf if low else np.inf
    info = np.iinfo(code.storage)
    return info.min if low else info.max


# bfloat16 words of 1.0, +inf and -inf.
_BF16_ONE = 0x3F80
_BF16_INF = 0x7F80
_BF16_MINUS_INF = 0xFF80
