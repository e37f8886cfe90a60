"""The express cycle: the cycle of a lone synchronous call of a form the ranks agreed on
before, whose negotiation is its message's form alone (one message each way on 2 ranks,
ceil(log2 p) rounds on more, see `exchange`), recognised by its bytes; and the
synchronous call that runs such a cycle without building a request (`call_now`, which the
allreduce kind uses for its blocking form).

`ExpressCycles` is a part of `Engine` (a base class of it): its methods read and change the
engine's state as the engine's own do (`engine.py` says what each attribute is), and talk to
MPI only while holding the engine's `_mpi` lock, as every cycle does. What a kind adds (the
data a message carries, what its copies or its collective make) comes through its kind
object or the callables a caller passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ...forensics import flight
from ...wire import GPU, UNNAMED, Response, Signature, numbered
from .. import activity
from ..errors import CommunicatorFailed
from ..kinds.kind import kind_of
from .exchange import compact, decode, messages, same_form
from .handles import Request, wake_waiters
from .negotiation import Plan

# call_now's agreed forms kept at most (a program with more shapes than this starts over).
_AGREED_CAPACITY = 4096


class ExpressCycles:
    """The express cycles of `Engine` (see the module's docstring)."""

    def _express(self, request: Request, cycle_start: float) -> bool | None:
        """The cycle of a lone request of a form the ranks agreed on before, with nothing
        else in flight here (a synchronous call's usual cycle); None, before anything is
        sent, when this cycle needs more than that (see `_run_cycle`).

        Its message names the request's slot (and carries its data when its kind carries
        it, see `carried`). When every peer sent a message of the same form, that is
        the whole negotiation: the request runs at once, without the plan of `decide`, the
        fusion of batches or the stall inspector, which have nothing to do in such a cycle.
        Otherwise the messages go through the general path, as any cycle's.
        """
        if self._express_ruled_out() or request.signature.place == GPU:
            return None
        cache = self._cache
        form = cache.form_for(request.name, request.cacheable, request.signature)
        if form is None:
            return None
        slot, bits, pairs = form
        carried = cache.eager_bytes[slot]
        kind = kind_of(request.signature.kind) if carried else None
        request.announced = cycle_start
        self.pending[request.name] = request
        wire, received, length = self._negotiate_alone(
            bits, pairs, kind.carried_pieces(request) if kind is not None else (), self.pending
        )
        if not length:
            return self._follow_in_full(wire, received, cycle_start)
        self.cycles_run += 1
        self.express_cycles += 1
        if kind is not None:
            del self.pending[request.name]
            kind.run_carried(self, request, received, length)
            self.collectives_run += 1
            self.transport.last_path = "eager"
        else:
            self.carried_copies = {}
            response = Response.everywhere(request.name, request.signature, self.size)
            self._execute(Plan([response], repeated=True, nothing_new=True))
        wake_waiters()
        self._last_activity = time.perf_counter()
        return False

    def _negotiate_alone(
        self,
        bits: int,
        pairs: Sequence[tuple[int, int]],
        carried: Sequence[bytes | memoryview],
        pending: Collection[str],
    ) -> tuple[bytes, list[bytes | bytearray], int]:
        """The next cycle's negotiation of this rank's lone request of an agreed form (its
        cached `bits` or numbered `pairs`, and the data its message `carried`): this rank's
        message, every rank's, and the length of the form they all share (0: a peer sent
        something else; `_follow_in_full` then runs the cycle)."""
        self._cycle += 1
        wire = compact(self._cycle, bits, pairs, carried, activity.current())
        received = self._exchange.send_and_receive(self._cycle, wire, pending)
        return wire, received, same_form(wire, received)

    def _follow_in_full(
        self, wire: bytes, received: list[bytes | bytearray], cycle_start: float
    ) -> bool:
        """Run a cycle of `_negotiate_alone` in which a peer sent something else as any
        cycle's, from every rank's message; True when the engine should stop."""
        return self._follow(messages(decode(wire), wire, received, 0), False, cycle_start)

    def _express_ruled_out(self) -> bool:
        """Whether this cycle needs the general path whatever its request: something else is
        in flight here, a rank has joined, the data communicator is to be renewed, a
        timeline records, or the stall inspector watches."""
        return bool(
            self.pending
            or self._joined_cycle
            or self._renew
            or self.timeline is not None
            or self._stalls.watching
        )

    def call_now(
        self,
        name: str,
        cacheable: bool,
        signature: Signature,
        number: int | None,
        nbytes: int,
        data: memoryview,
        from_copies: Callable[[Sequence[Any], int], Any],
        run: Callable[[], Any],
        build: Callable[[str], Request],
    ) -> Any:
        """A synchronous host collective of a form the ranks agreed on before, with nothing
        else in flight: its express cycle (see `_express`) and, when its data is larger than
        the message carries, its collective, on the caller's thread without a request, a
        handle or a queue.

        `signature` is the request's (`number`: the name is the unnamed request of that
        number, see `unnamed_number`); `data` its `nbytes` bytes, which the message carries
        when the cache says so. When every rank's message carried it, `from_copies(copies,
        offset)` makes the result from every rank's copy; otherwise `run()` runs the
        collective and returns the result. Should the cycle need more (a peer sent something
        else, or it failed), `build(name)` makes the request, which takes the usual path from
        there.

        Returns the result; the handle to wait for when the cycle needed more; or None,
        before anything was sent, when the call cannot run here (submit it as usual).
        """
        record = self.flight
        with self._mutex:
            if (
                self._failure is not None
                or self._stop_requested
                or name in self._in_flight
                or not self._caller_may_run()
            ):
                return None
            # This thread holds `_mpi` now: nothing else runs a cycle (or changes the cache).
            try:
                form = self._agreed_form(name, cacheable, signature, number)
            except BaseException:
                self._mpi.release()
                raise
            if form is None:
                self._mpi.release()
                if self._queue:
                    self._lock.notify_all()  # submitted meanwhile by another thread
                return None  # the caller submits it as usual
            self._in_flight[name] = None
            start = time.perf_counter()
            # Recorded before anything is sent: a hang in this cycle shows it pending. The
            # entry stays with this call (no lookup by name). Its site is found once per
            # name, or each time for an unnamed call, from the frame that called the kind's
            # function (4 up from `enter`: this one, the kind's `_now` and its function lie
            # between, ringplug's own; each frame looked at costs a frame object).
            entry = record.enter(name, signature, start, cacheable, 4) if record.capacity else None
        request: Request | None = None
        done_at = 0.0
        try:
            bits, pairs, signature, carried = form
            try:
                wire, received, length = self._negotiate_alone(
                    bits, pairs, (data,) if carried else (), (name,)
                )
                if not length:  # a peer sent something else: the full negotiation
                    request = self._adopt(name, cacheable, build, start, entry)
                    if self._follow_in_full(wire, received, start):
                        self._ended = True
            except BaseException as exc:  # noqa: BLE001 - as `_guarded_cycle`
                if request is None:
                    request = self._adopt(name, cacheable, build, start, entry)
                self._cycle_failed(exc)
            self.cycles_by_callers += 1
            if request is not None:
                return request.handle
            self.cycles_run += 1
            self.express_cycles += 1
            if carried:
                self.collectives_run += 1
                self.transport.last_path = "eager"
                # The same copies on every rank: an error here is raised alike everywhere.
                result = from_copies(received, length)
                self.calls_now += 1
                self._last_activity = done_at = time.perf_counter()
                return result
            try:
                result, request = self._run_now(
                    name,
                    signature,
                    run,
                    lambda: self._adopt(name, cacheable, build, start, entry, pending=False),
                )
            except BaseException as exc:  # noqa: BLE001 - as `_guarded_cycle`
                request = self._adopt(name, cacheable, build, start, entry)
                self._cycle_failed(exc)
            if request is not None:
                return request.handle
            self.calls_now += 1
            self._last_activity = done_at = time.perf_counter()
            return result
        finally:
            if request is None:
                if entry is not None:
                    flight.finish(entry, start, done_at or time.perf_counter())
                with self._mutex:
                    self._in_flight.pop(name, None)
            self._mpi.release()
            if request is not None:
                self._after_driving(request.handle)
            elif self._queue:
                with self._lock:
                    self._lock.notify_all()  # submitted meanwhile by another thread

    def _run_now(
        self,
        name: str,
        signature: Signature,
        run: Callable[[], Any],
        adopt: Callable[[], Request],
    ) -> tuple[Any, Request | None]:
        """The collective of a `call_now` too large to travel in the message, as the usual
        path runs it: (its result, None). When it fails (a peer failed an earlier
        collective of the cycle, or this one failed), the request `adopt()` makes fails as
        the usual path's would, and is returned. A communicator failure raises."""
        self._failed_here, self._position = None, 0
        response = Response.everywhere(name, signature, self.size)
        skipped = self.begin_collective(kind_of(signature.kind).label, [response])
        if skipped is not None:
            request = adopt()
            self.complete_each([request], error=skipped)
            return None, request
        try:
            result = run()
        except CommunicatorFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or peers hang
            request = adopt()
            self.collective_failed(exc, [request])
            return None, request
        self.collectives_run += 1
        return result, None

    def _agreed_form(
        self, name: str, cacheable: bool, signature: Signature, number: int | None
    ) -> tuple[int, tuple[tuple[int, int], ...], Signature, bool] | None:
        """The cached bits and numbered pairs of `call_now`'s message, the cache's signature
        of it and whether its data travels in the message, when nothing else is in flight
        and the ranks agreed on this form before (else None)."""
        if self._express_ruled_out():
            return None
        if cacheable:
            parts = None
        else:
            parts = (UNNAMED, number) if number is not None else numbered(name)
            if parts is None:
                return None
        key = (name if parts is None else parts[0], signature)
        cache = self._cache
        known = self._agreed.get(key)
        if known is None or cache.slots[known[1]][1] is not known[0]:
            form = cache.form_for(name, parts is None, signature)
            if form is None:
                return None
            slot = form[0]
            if len(self._agreed) >= _AGREED_CAPACITY:
                self._agreed.clear()
            known = self._agreed[key] = (cache.slots[slot][1], slot)
        signature, slot = known
        carried = cache.eager_bytes[slot] > 0  # not larger than the eager threshold
        if parts is None:
            return 1 << slot, (), signature, carried
        return 0, ((slot, parts[1]),), signature, carried

    def _adopt(
        self,
        name: str,
        cacheable: bool,
        build: Callable[[str], Request],
        start: float,
        entry: list[Any] | None,
        pending: bool = True,
    ) -> Request:
        """The request of a `call_now` whose cycle needs the usual path, `pending` as
        if it had been submitted (else it is about to be completed); it takes over the
        call's flight record `entry`."""
        request = build(name)
        request.cacheable = cacheable
        request.submitted = request.announced = start
        request.handle._engine = self  # its waiter may run the cycles (see `drive`)
        request.flight = entry
        with self._mutex:
            self._in_flight[name] = request.handle
        if pending:
            self.pending[name] = request
        return request
