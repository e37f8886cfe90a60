"""The stall inspector: requests that some ranks submitted and others did not.

Each cycle's plan lists them (`Plan.partial`). Rank 0 warns after
`RINGPLUG_STALL_CHECK_SECONDS`, naming who has each request and who lacks it; after
`RINGPLUG_STALL_SHUTDOWN_SECONDS` it tells every rank (in its next message) to fail them
alike. A rank that waits in one past `RINGPLUG_TIMEOUT` ends the job naming the ranks
that never submitted it; one with a timeout of its own (a barrier's, `Request.timeout`)
instead fails on this rank alone once that has passed, naming them too.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ...config import Settings
from .. import activity, log
from ..errors import BarrierTimeoutError, StallError
from .negotiation import Plan

if TYPE_CHECKING:
    from .handles import Request

logger = logging.getLogger(__name__)


class StallInspector:
    """Tracks since when each partly submitted request has waited, on one rank."""

    def __init__(
        self, settings: Settings, rank: int, size: int, ranks: tuple[int, ...] | None = None
    ) -> None:
        self.settings = settings
        self.rank, self.size = rank, size
        # How the ranks are named: a process set's members by their rank in the world.
        self._world = ranks if ranks is not None else tuple(range(size))
        # What its reports add: which process set (empty for the world's engine).
        self.scope_text = ""
        self._partial_since: dict[str, float] = {}
        self._warned: set[str] = set()
        self._abort: list[str] = []  # rank 0's verdict, for its next message
        # Rank 0's request, for its next message: these ranks show their stacks (and every
        # rank writes its flight record).
        self._report: list[int] = []
        # Requests whose own timeout passed, with their errors, for the engine to fail here.
        self._expired: list[tuple[str, BaseException]] = []
        # Every rank's training phase as its last message carried it (`core/activity.py`).
        self.activities: list[tuple[str, float]] = []
        # Nothing is watched, decided or to be taken: a cycle whose plan lacks nothing
        # anywhere needs no `inspect`, and this rank's message has no verdict to carry.
        self.quiet = True

    def _settle(self) -> None:
        """Recompute `quiet` after the state changed."""
        self.quiet = not (self._partial_since or self._abort or self._report or self._expired)

    def take_expired(self) -> list[tuple[str, BaseException]]:
        """The requests whose own timeout passed (name, error), once: the engine fails them
        on this rank."""
        expired, self._expired = self._expired, []
        self._settle()
        return expired

    def take_abort(self) -> list[str]:
        """The requests rank 0 decided to fail, once (they go into its next message)."""
        names, self._abort = self._abort, []
        self._settle()
        return names

    def take_report(self) -> list[int]:
        """The ranks rank 0 asks to show where they are, once (for its next message)."""
        ranks, self._report = self._report, []
        self._settle()
        return ranks

    def inspect(self, plan: Plan, pending: dict[str, Request]) -> StallError | None:
        """Look at this cycle's plan: warn (rank 0) about requests some ranks lack, end the
        job past the timeout, and return the error to fail everything with when rank 0
        decided (in the previous cycle) to shut the stalled requests down."""
        if not (plan.partial or self._partial_since or plan.stall_abort):
            return None  # nothing is missing anywhere (the usual cycle)
        try:
            return self._inspect(plan, pending)
        finally:
            self._settle()

    def _inspect(self, plan: Plan, pending: dict[str, Request]) -> StallError | None:
        now = time.monotonic()
        for name in list(self._partial_since):
            if name not in plan.partial:
                del self._partial_since[name]
                self._warned.discard(name)
        for name in plan.partial:
            self._partial_since.setdefault(name, now)
        if plan.stall_abort:
            return StallError(self._text(plan, plan.stall_abort, now))
        overdue = [
            n
            for n, t in self._partial_since.items()
            if n in pending and not pending[n].timeout and now - t >= self.settings.timeout
        ]
        # A request's own timeout counts from when this rank submitted it.
        submitted_now = time.perf_counter()
        self._expired = [
            (n, self._timed_out(n, plan, pending[n], submitted_now - pending[n].announced))
            for n in plan.partial
            if n in pending
            and pending[n].timeout
            and submitted_now - pending[n].announced >= pending[n].timeout
        ]
        if overdue:
            name = overdue[0]
            missing = [r for r in range(self.size) if r not in plan.partial[name]]
            kind = pending[name].signature.kind.label
            log.end_job(
                self._world[self.rank],
                f"rank {self._world[self.rank]} waited {now - self._partial_since[name]:.0f} s "
                f"in {kind} {name!r} for rank(s) {self._names(missing)}, which never submitted it "
                f"(RINGPLUG_TIMEOUT={self.settings.timeout:g})"
                f"{_then(activity.describe(missing, self.activities, plan.partial))}. Ending "
                "the job: MPI cannot cancel a collective. Look at what the missing ranks were "
                "doing (a stuck data loader, an uneven number of batches, a branch only some "
                f"ranks take).{self.scope_text}",
                culprits=[self._world[r] for r in missing],
            )
        if self.rank != 0:
            return None
        check, shutdown = self.settings.stall_check_seconds, self.settings.stall_shutdown_seconds
        late = [n for n, t in self._partial_since.items() if now - t >= check]
        fresh = [n for n in late if n not in self._warned]
        if fresh:
            self._warned.update(fresh)
            # At WARNING on the world's rank 0 only: other ranks log errors only (`log`), and
            # a process set's rank 0 may be any rank of the world.
            level = logging.WARNING if self._world[self.rank] == 0 else logging.ERROR
            logger.log(level, "%s", self._text(plan, late, now))
            holders = [set(plan.partial.get(name, ())) for name in fresh]
            self._report = sorted(set().union(*(set(range(self.size)) - h for h in holders)))
        if shutdown > 0:
            doomed = [n for n, t in self._partial_since.items() if now - t >= shutdown]
            if doomed:
                self._abort = doomed  # sent in the next cycle, so every rank fails alike
        return None

    def _timed_out(
        self, name: str, plan: Plan, request: Request, waited: float
    ) -> BarrierTimeoutError:
        """The error of a request whose own timeout passed on this rank after `waited` s."""
        missing = [r for r in range(self.size) if r not in plan.partial.get(name, [])]
        doing = activity.describe(missing, self.activities, plan.partial)
        return BarrierTimeoutError(
            f"rank {self._world[self.rank]} waited {waited:.0f} s in "
            f"{request.signature.kind.label} {name!r} (its timeout: {request.timeout:g} s) for "
            f"rank(s) {self._names(missing)}, which never called it{_then(doing)}."
            f"{self.scope_text}",
            caused_by=tuple(self._world[r] for r in missing),
        )

    def _names(self, ranks: Any) -> str:
        """`ranks` (the engine's own numbers) as the world's ranks, as messages list them."""
        return ranks_text(self._world[r] for r in ranks)

    def _text(self, plan: Plan, names: list[str], now: float) -> str:
        active = range(self.size)
        parts = []
        for name in sorted(names)[:20]:
            holders = plan.partial.get(name, [])
            missing = [r for r in active if r not in holders]
            waited = now - self._partial_since.get(name, now)
            doing = activity.describe(missing, self.activities, plan.partial)
            parts.append(
                f"{name!r} is ready on rank(s) {self._names(holders)} but not on rank(s) "
                f"{self._names(missing)} (for {waited:.0f} s{_then(doing)})"
            )
        return (
            "Stalled collectives: " + "; ".join(parts) + ". The missing ranks are elsewhere in "
            "the program: a different number of batches, a branch only some ranks take, or "
            "tensors submitted in a different set (RINGPLUG_STALL_CHECK_SECONDS="
            f"{self.settings.stall_check_seconds:g}, RINGPLUG_STALL_SHUTDOWN_SECONDS="
            f"{self.settings.stall_shutdown_seconds:g}).{self.scope_text}"
        )


def _then(clause: str) -> str:
    return f"; {clause}" if clause else ""


def ranks_text(ranks: Any) -> str:
    """Ranks as messages list them: "0, 2", or "none"."""
    return ", ".join(map(str, ranks)) or "none"
