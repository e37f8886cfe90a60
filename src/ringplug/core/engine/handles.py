"""What a submitted collective is: its `Request` (for the engine) and its `Handle` (for the
caller)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ...wire import Signature


class Driver(Protocol):
    """What a handle needs of the engine that may run its cycle on the waiting thread."""

    def drive(self, handle: Handle) -> None: ...


logger = logging.getLogger(__name__)

# One signal for every handle of the process: the engine notifies it once per cycle
# instead of waking one event per tensor.
_completed = threading.Condition()
_callbacks_lock = threading.Lock()
# Threads inside `_completed.wait_for`: with none (a caller that ran its own cycle, the
# usual case of a synchronous call) the engine skips the notify.
_sleepers = 0


class Handle:
    """A collective in flight. `wait()` returns its result or raises its error.

    Every rank gets the same outcome: the result, or the same error naming the ranks
    involved.
    """

    __slots__ = ("name", "_done", "_result", "_error", "_callbacks", "_engine")

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] | None = None
        self._engine: Driver | None = None  # set when the waiter may run the engine's cycles

    @classmethod
    def completed(cls, name: str, result: Any) -> Handle:
        """A handle of a collective that has already finished with `result`."""
        handle = cls(name)
        handle._done, handle._result = True, result
        return handle

    def done(self) -> bool:
        """Whether the collective has finished (successfully or not); never blocks."""
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective finished; return its result or raise its error."""
        engine = self._engine
        if engine is not None and not self._done:
            engine.drive(self)
        if not self._done:
            global _sleepers
            with _completed:
                _sleepers += 1
                try:
                    finished = _completed.wait_for(lambda: self._done, timeout)
                finally:
                    _sleepers -= 1
                if not finished:
                    raise TimeoutError(
                        f"collective {self.name!r} did not finish within {timeout} s"
                    )
        if self._error is not None:
            raise self._error
        return self._result

    synchronize = wait

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call `callback(handle)` once the collective has finished (at once if it has).

        Callbacks run on the thread that ran the collective (the engine thread, or a caller
        waiting in `wait()`): they must be quick and must not wait for another collective
        (hand the work to a thread of your own).
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
        if callbacks:
            self._call_back(callbacks)

    def _call_back(self, callbacks: list[Callable[[Handle], None]]) -> None:
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - one caller's callback must not stop the engine
                logger.exception("a callback of collective %r failed", self.name)


def finish_each(
    handles: list[Handle], results: list[Any], errors: list[BaseException | None]
) -> None:
    """`Handle._finish` of each handle of a batch with its result and error, under one hold
    of the callbacks' lock (a fused batch finishes hundreds of handles at once)."""
    for handle, result, error in zip(handles, results, errors, strict=True):
        handle._result, handle._error = result, error
    called = []
    with _callbacks_lock:
        for handle in handles:
            handle._done = True
            if handle._callbacks is not None:
                called.append((handle, handle._callbacks))
                handle._callbacks = None
    for handle, callbacks in called:
        handle._call_back(callbacks)


def wake_waiters() -> None:
    """Wake the threads waiting for a handle, after handles finished.

    Reading `_sleepers` without the lock is safe: a handle is marked done before this is
    called, and a thread that starts waiting after the read checks `_done` under the lock
    before it sleeps.
    """
    if _sleepers:
        with _completed:
            _completed.notify_all()


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One collective submitted on this rank: what every kind has, and the kind's own
    `payload` (its buffers and factors: `fusion.Reduction` for an allreduce, `kind.Buffer`
    for the one-buffer kinds, the pickled bytes of an object).

    GPU requests (``signature.place == GPU``) hold `DeviceBuffer`s where host ones hold
    flat contiguous arrays in their storage type.
    """

    name: str
    signature: Signature
    handle: Handle
    payload: Any = None
    cacheable: bool = False
    extra: int = 0  # negotiated per rank: first dimension (allgather, alltoall), object bytes
    error: BaseException | None = None  # Kind.ERROR: what this rank rejected
    finish: Callable[[Any], Any] | None = None  # turns the raw result into the user's
    # What the handle gets when the collective leaves no result of its own and there is no
    # `finish` (an allreduce's output array: no closure per request to return it).
    result: Any = None
    submitted: float = 0.0
    announced: float = 0.0
    flight: list[Any] | None = None  # its entry in the flight record (`forensics.flight`)
    # Seconds this rank waits for the others to submit it before failing it here alone
    # (`BarrierTimeoutError`); 0: `RINGPLUG_TIMEOUT`, after which the job ends.
    timeout: float = 0.0
    number: int = 0  # an unnamed request's number (its name is "noname.<number>"), else 0
