"""The one cycle of an engine: negotiate, plan, run.

Every collective of every kind, synchronous or not, goes through `Cycle.run`, on whichever
thread the scheduler gave the turn to (`scheduler`):

1. **take** the requests submitted since the last cycle (or the one request of the caller
   that runs this cycle for it), and read this cycle's settings (`settings`: the one place
   the cycle reads `Engine.settings`, once it has taken its requests, so that a change
   takes effect at the next cycle, and one made before a request was submitted holds for
   every cycle that runs it);
2. **negotiate** (`negotiate`): every rank gets every rank's message. Its fast path: a lone
   request of a form the ranks agreed on before is named by its form alone (its cache slot,
   and its data when small, see `carried`); when every rank sent that same form, recognised
   by its bytes, the plan is that request, without decoding a message or running `decide`.
   Otherwise the messages are decoded and `negotiation.decide` makes the plan, the same on
   every rank;
3. **run** the plan (`run_plan`): consecutive requests of a kind that fuses in one batch
   (`batches`), every other alone, each through its kind's object; then complete the
   handles, check for stalls and expired timeouts, finish a join, and mark the timeline.

Steps 1 and 3 are the same on both paths of step 2, so every engine feature (timeline,
stall inspector, join, flight record, traffic counts, mismatch errors, deadlines) applies
to every cycle.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from ...config import Settings
from ...wire import (
    GPU,
    UNNAMED,
    Kind,
    Message,
    Response,
    Signature,
    cacheable_name,
    numbered,
)
from .. import activity
from ..errors import CommunicatorFailed, MismatchError, PeerArgumentError, PeerFailedError
from ..kinds.kind import KINDS, EngineView, SameEverywhere, check_joined, kind_of
from . import carried
from .batches import batches
from .exchange import PAIR, decode, form_parts, message_from, messages, same_form
from .handles import Request, wake_waiters
from .negotiation import Cache, Plan, decide
from .scheduler import BURST_WAIT_SECONDS, Scheduler

if TYPE_CHECKING:
    from mpi4py import MPI

    from ...forensics.flight import FlightRecorder
    from ..autotune import Autotuner
    from .exchange import Exchange
    from .stalls import StallInspector

_CACHE_CAPACITY = 4096
# What a lone plan has none of, shared by every lone plan (nothing changes a plan).
_NO_ERRORS: dict[str, str] = {}
_NO_PARTIAL: dict[str, list[int]] = {}
_NO_ABORT: list[str] = []


class Cycled(EngineView, Protocol):
    """What a cycle needs of its engine beyond what a kind does (`engine.Engine` has it; no
    import of the engine here, which imports this module)."""

    ranks: tuple[int, ...] | None
    ctrl: MPI.Comm | None
    left_early: bool
    exchange: Exchange
    scheduler: Scheduler
    stalls: StallInspector
    flight: FlightRecorder
    tuner: Autotuner | None

    @property
    def scope_text(self) -> str: ...

    def cycle_failed(self, exc: BaseException) -> None: ...

    def fail_everything(self, error: BaseException) -> None: ...

    def finish_join(self, last: int) -> None: ...

    def follow_unnamed(self, names: Iterable[str]) -> None: ...

    def report_where(self, reason: str, stacks: bool = False) -> None: ...

    def shut_down(self, by: int) -> None: ...


class Cycle:
    """The state one engine's cycles share, and the cycle itself (see the module).

    Only the thread holding the scheduler's turn touches it.
    """

    def __init__(self, engine: Cycled, eager_threshold: int) -> None:
        self.engine = engine
        self.number = 0  # of the last cycle (the same on every rank)
        # This rank's requests negotiated and not yet run, by name.
        self.pending: dict[str, Request] = {}
        # Agreed requests by slot, the same on every rank (`negotiation.Cache`).
        self.cache = Cache(_CACHE_CAPACITY, eager_threshold)
        # This cycle's data carried in the messages: name -> every rank's copy (`carried`).
        # One dictionary, refilled each cycle (`Engine.carried_copies` is the same one).
        self.carried_copies: dict[str, list[memoryview]] = {}
        self.joined_cycle = 0  # the cycle in which this rank joined (0: it has not)
        self.renew = False  # a collective was abandoned: renew the data communicator
        self.position = 0  # of the next collective in this cycle's plan
        self.failed_here: PeerFailedError | None = None  # a collective of this cycle failed
        # The fast path's carried data: every rank's message as received, and where the
        # data starts in each (`run_plan` completes the lone request from them).
        self._carried_alone: tuple[list[bytes | bytearray], int] | None = None
        # This cycle's settings: `run` reads `Engine.settings` once it has taken its requests.
        self.settings: Settings = engine.settings
        # The last plan's responses, the fusion threshold and their batches (a repeated
        # step reuses them).
        self._last_batches: tuple[list[Response], int, list[list[Response] | Response]] | None = (
            None
        )
        # The fast path's plans and message forms, by cache slot (`Lone`): a synchronous
        # call repeated in a loop runs the same plan.
        self._lones: dict[int, Lone] = {}

    # ------------------------------------------------------------------ the cycle
    def run(self, fresh: list[Request] | None, by_caller: bool) -> bool:
        """One cycle: of the queued requests (`fresh` None), or of `fresh`, a waiting
        caller's own request; `by_caller`: run by a waiting caller, not the engine thread.
        True when the engine must stop (it was shut down, or the cycle failed: everything
        in flight then fails with the cause)."""
        engine = self.engine
        scheduler = engine.scheduler
        try:
            # A waiting caller's own cycle starts as it submits: one clock reading less.
            start = fresh[0].submitted if by_caller and fresh else time.perf_counter()
            on_engine_thread = not by_caller
            stopping = False
            if fresh is None:
                if engine.settings.cycle_time > 0:
                    time.sleep(engine.settings.cycle_time)  # let more requests gather for fusion
                elif on_engine_thread:
                    scheduler.let_burst_finish(start + BURST_WAIT_SECONDS)
                fresh, stopping = scheduler.take_submissions(on_engine_thread)
                if fresh and engine.flight.capacity:  # here, on the thread that runs cycles
                    engine.flight.add_latest(fresh)
            elif engine.flight.capacity:
                # The caller's own request, on its thread: its site is found from here (the
                # user's frame is usually 3 above `Scheduler.submit`, 5 above `add_own`).
                engine.flight.add_own(fresh[0], 5)
            # Where a cycle reads the engine's settings (its wait aside): replacing
            # `Engine.settings` (a frozen dataclass) changes the fusion threshold and cycle
            # time from here on. Read once the requests are taken, not before the wait: a
            # setting changed between two steps (`autotune.tune_from`, the bench's segments:
            # after a barrier, before submitting) then holds on every rank for every request
            # submitted after it. Read before the wait, it was the old one where the engine
            # thread had begun this cycle and the new one on the other ranks, which fused
            # the same plan differently (MPI's messages truncated: the job failed).
            self.settings = engine.settings
            if fresh:
                pending = self.pending
                for request in fresh:
                    request.announced = start
                    pending[request.name] = request
            self.number += 1
            plan, received = self.negotiate(stopping)
            if received is None and by_caller:
                engine.counters.fast_by_callers += 1
            stop = self.follow(plan, received, start)
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear about it
            engine.cycle_failed(exc)
            return True
        if stop:
            scheduler.ended = True
        return stop

    def negotiate(self, stopping: bool) -> tuple[Plan, list[Message] | None]:
        """This cycle's plan from every rank's message, and the messages (None when the
        fast path made the plan: a lone request of an agreed form, and every rank sent
        that form)."""
        engine = self.engine
        exchange = engine.exchange
        pending = self.pending
        lone = self._lone_form(stopping)
        if lone is not None:
            request, slot, number = lone
            prepared = self._lones.get(slot)
            if prepared is None or (
                prepared.signature is not request.signature  # a plain call's is shared
                and prepared.signature != request.signature
            ):
                prepared = self._prepare(request, slot)  # new, or the slot was given anew
            nbytes = prepared.nbytes  # 0 on one rank
            if engine.size == 1:  # no message to send: this rank's form is every rank's
                wire, received, length = b"", [], 1
            else:
                pieces = KINDS[request.signature.kind].carried_pieces(request) if nbytes else ()
                pair = b"" if request.cacheable else PAIR.pack(slot, number)
                wire = message_from(self.number, prepared.form, pair, pieces, activity.current())
                received = exchange.send_and_receive(self.number, wire, pending)
                length = same_form(wire, received, prepared.form[2])
            if length:
                # Every rank has this request alone: it is the plan. (The peers' phases stay
                # unread: nothing is missing anywhere, so no stall report needs them.)
                engine.counters.fast_cycles += 1
                if self.carried_copies:
                    self.carried_copies.clear()
                if nbytes:
                    self._carried_alone = (received, length)
                plan = prepared.plan
                plan.responses[0].name = request.name
                return plan, None
            found, alike = messages(decode(wire), wire, received, 0), False
        else:
            own = self._message(stopping)
            found, alike = exchange.exchange(self.number, own, pending)
        if found[0] is not found[-1] or len(found) == 1:
            # For the stall reports (a cycle the ranks agreed on without gathering their
            # messages left the peers' phases unknown: the last ones known stay).
            engine.stalls.activities = [m.activity for m in found]
        if found[0].report:  # rank 0 saw a stall: show where this rank is
            engine.report_where("rank 0 saw it stall", engine.rank in found[0].report)
        plan = decide(found, self.cache, alike, engine.ranks)
        copies = self.carried_copies
        copies.clear()
        copies.update(carried.received(found, self.cache, plan.repeated))
        return plan, found

    def _prepare(self, request: Request, slot: int) -> Lone:
        """The `Lone` of cache `slot`, which `request` names, kept for the slot's next
        request (`negotiate` looks for it first)."""
        response = Response.everywhere(request.name, request.signature, self.engine.size)
        # By position, with the shared empty errors, partial and stall lists.
        plan = Plan([response], _NO_ERRORS, _NO_PARTIAL, None, False, -1, _NO_ABORT, True, True)
        nbytes = self.cache.eager_bytes[slot]
        # Named by its bit, or by its numbered pair.
        form = form_parts(1 << slot, 0, nbytes) if request.cacheable else form_parts(0, 1, nbytes)
        prepared = self._lones[slot] = Lone(request.signature, plan, form, nbytes)
        return prepared

    def _lone_form(self, stopping: bool) -> tuple[Request, int, int] | None:
        """(request, slot, number) when this rank's message can be the form of a lone
        request agreed before: one request pending, and nothing else to say (no shutdown,
        join, renewal or stall verdict, which a message spells out). `number`: its number
        in its numbered slot (0 when it has a slot of its own)."""
        pending = self.pending
        if (
            len(pending) != 1
            or stopping
            or self.joined_cycle
            or self.renew
            or not self.engine.stalls.quiet  # a verdict to carry, or requests watched
        ):
            return None
        for request in pending.values():
            cache = self.cache
            if request.cacheable:  # `Cache.form_for`, written out: this runs every call
                slot = cache.by_name.get(request.name)
                if slot is None or cache.slots[slot][1] != request.signature:
                    return None
                return request, slot, 0
            # `Cache.numbered_slot`, written out too; an unnamed request knows its number
            parts = (UNNAMED, request.number) if request.number else numbered(request.name)
            if parts is None:
                return None
            slot = cache.by_prefix.get((parts[0], request.signature))
            if slot is None:
                return None
            return request, slot, parts[1]
        return None

    def _message(self, stopping: bool) -> Message:
        """This rank's full message: every pending request by slot, number or in full."""
        message = Message(self.number, joined_cycle=self.joined_cycle, shutdown=stopping)
        message.renew, self.renew = self.renew, False
        message.activity = activity.current()
        cache = self.cache
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
        stalls = self.engine.stalls
        message.stall_abort = stalls.take_abort()
        message.report = stalls.take_report()
        return message

    def follow(self, plan: Plan, found: list[Message] | None, start: float) -> bool:
        """Run `plan` and what follows it (stalls, join, timeline); True when the engine
        must stop. `found`: every rank's message (None: the fast path's plan)."""
        engine = self.engine
        counters = engine.counters
        counters.cycles_run += 1
        if found is not None:
            if plan.shutdown_by is not None:
                if plan.shutdown_by == engine.rank:
                    engine.left_early = any(
                        (m.cached or m.new) and not m.shutdown
                        for r, m in enumerate(found)
                        if r != engine.rank
                    )
                engine.shut_down(plan.shutdown_by)
                return True
            if any(m.renew for m in found) and engine.ctrl is not None:
                engine.transport.renew(engine.ctrl)
        if not plan.nothing_new:
            pending = self.pending
            cacheable = {n for n, r in pending.items() if r.cacheable}
            # A joined rank lacks the others' requests; it must still learn the same slots
            # (given names are the cacheable ones), or its cache parts from theirs.
            cacheable.update(
                r.name for r in plan.responses if r.name not in pending and cacheable_name(r.name)
            )
            self.cache.learn(plan, cacheable)
        self.run_plan(plan)
        stalls = engine.stalls
        if plan.partial or plan.stall_abort or not stalls.quiet:
            stalled = stalls.inspect(plan, self.pending)
            if stalled is not None:
                engine.fail_everything(stalled)
            for name, error in stalls.take_expired():  # a barrier's own timeout passed
                engine.complete(self.pending.pop(name), error=error)
        if plan.all_joined:
            engine.finish_join(plan.last_joined)
        wake_waiters()
        if plan.responses or plan.errors:
            counters.last_activity = time.perf_counter()
        timeline = engine.timeline
        if timeline is not None:
            timeline.marker(f"cycle {self.number}", start, ran=len(plan.responses))
            timeline.flush()
        return False

    # ------------------------------------------------------------------ running a plan
    def run_plan(self, plan: Plan) -> None:
        """Fail the plan's mismatches, then run its collectives in order, fused in batches
        where their kind fuses."""
        engine = self.engine
        if engine.scheduler.join_handle is not None:
            engine.follow_unnamed([r.name for r in plan.responses] + list(plan.errors))
        if plan.errors:
            for name, message in plan.errors.items():
                request = self.pending.pop(name, None)
                if request is not None:
                    error = _mismatch_error(request, message + engine.scope_text)
                    engine.complete(request, error=error)
        self.failed_here = None
        self.position = 0
        carried_alone = self._carried_alone
        if carried_alone is not None:  # the fast path's lone request, its data carried
            self._carried_alone = None
            request = self.pending.pop(plan.responses[0].name)
            KINDS[request.signature.kind].run_carried(engine, request, *carried_alone)
            engine.counters.collectives_run += 1
            engine.transport.last_path = "eager"
        elif len(plan.responses) == 1:  # a lone request (a synchronous call): no batches
            only = plan.responses[0]
            collective = kind_of(only.signature.kind)
            if collective.fused:
                collective.run_batch(engine, plan.responses)
            else:
                self._run_single(only)
        else:
            for item in self._batches(plan.responses):
                if isinstance(item, list):
                    kind_of(item[0].signature.kind).run_batch(engine, item)
                else:
                    self._run_single(item)
        if engine.tuner is not None:  # the same plan at the same cycle on every rank
            engine.tuner.after_cycle(self.number, plan.responses)

    def _batches(self, responses: list[Response]) -> list[list[Response] | Response]:
        """`batches` of this plan's responses: the last plan's own batches when it ran the
        same list (a repeated step, see `Cache.repeated`)."""
        threshold = self.settings.fusion_threshold
        last = self._last_batches
        # `responses` is kept alive here, so `is` is safe; a new threshold batches anew.
        if last is not None and last[0] is responses and last[1] == threshold:
            return last[2]
        found = list(batches(responses, threshold))
        self._last_batches = (responses, threshold, found)
        return found

    def _run_single(self, response: Response) -> None:
        """Run a collective that is not fused (everything but allreduce) through its kind."""
        engine = self.engine
        signature = response.signature
        request = self.pending.pop(response.name, None)
        if signature.kind is Kind.ERROR:  # every rank rejected its arguments: each raises its own
            if request is not None:
                engine.complete(request, error=request.error)
            return
        collective = kind_of(signature.kind)
        start = time.perf_counter()
        if signature.place != GPU:
            skipped = engine.begin_collective(collective.label, [response])
            if skipped is not None:
                engine.complete_each([request], error=skipped)
                return
        try:
            check_joined(signature, response)
            if signature.place == GPU:
                result = collective.run_gpu(engine, response, request)
            else:
                result = collective.run_host(engine, response, request)
        except CommunicatorFailed as exc:
            if request is not None:
                engine.complete(request, error=exc)
            raise  # every other GPU collective must fail too
        except SameEverywhere as exc:  # raised alike on every rank, before any data moved
            if request is not None:
                engine.complete(request, error=exc)
            return
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or peers hang
            if signature.place == GPU:
                if request is not None:
                    engine.complete(request, error=exc)
                return
            engine.collective_failed(exc, [request])
            return
        engine.counters.collectives_run += 1
        if request is not None:
            engine.complete(request, result=result)
            timeline = engine.timeline
            if timeline is not None:
                engine.trace_wait(timeline, request, start)
                timeline.span(request.name, signature.kind.name, start, time.perf_counter())


class Lone:
    """A cache slot's lone cycle, prepared once (`Cycle._prepare`): the plan of a cycle in
    which every rank has the slot's request alone, and the constant parts of the message
    that names it (`exchange.form_parts`).

    The plan's one response takes the name of each request of the slot (an unnamed call's
    differs every time); nothing else ever changes it once made.
    """

    __slots__ = ("signature", "plan", "form", "nbytes")

    def __init__(
        self,
        signature: Signature,
        plan: Plan,
        form: tuple[bytes, bytes, int],
        nbytes: int,
    ) -> None:
        # The requests' (a slot given anew prepares anew): everything here follows from it
        # and the slot, so a request of an equal signature runs this plan.
        self.signature = signature
        self.plan = plan
        self.form = form
        self.nbytes = nbytes  # of data its message carries (0: none)


def _mismatch_error(request: Request, message: str) -> BaseException:
    if request.error is not None:
        return request.error
    if "rejected their arguments" in message:
        return PeerArgumentError(message)
    return MismatchError(message)
