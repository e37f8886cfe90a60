"""Barrier: done once every rank has called it."""

from __future__ import annotations

from typing import Any

from ...wire import Kind, Response, Signature
from ..engine.handles import Handle, Request
from .base import (
    blocking,
    name_request,
    submit,
)
from .kind import CollectiveKind, EngineView, register


def barrier_async(name: str | None = None, timeout: float | None = None) -> Handle:
    """Start a barrier; the handle is done once every rank has called it.

    Args:
        name: matches the call across ranks. Defaults to the next unnamed one.
        timeout: seconds this rank waits for the others, after which its handle fails with
            `BarrierTimeoutError` naming the ranks that never called it (as torch's
            ``monitored_barrier``), and the job goes on. Defaults to ``None``:
            ``RINGPLUG_TIMEOUT``, after which the job ends naming them.
    """
    request_name, _ = name_request(name)

    def build(n: str) -> Request:  # a bad timeout fails the barrier on every rank
        return Request(n, Signature(Kind.BARRIER), Handle(n), timeout=_seconds(timeout))

    return submit(request_name, False, build)


barrier = blocking(
    barrier_async,
    None,
    """Wait until every rank has called barrier (see
`barrier_async` for `timeout`).""",
)


def _seconds(timeout: float | None) -> float:
    """A barrier's own timeout in seconds (0.0: none), or ValueError."""
    if timeout is None:
        return 0.0
    seconds = float(timeout)
    if not 0 < seconds < float("inf"):
        raise ValueError(
            f"barrier timeout={timeout!r}: give a positive, finite number of seconds, or None "
            "for RINGPLUG_TIMEOUT."
        )
    return seconds


class Barrier(CollectiveKind):
    """Negotiation itself is the barrier: once every rank has it ready, it is done."""

    label = "barrier"

    def run_host(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        return None


register(Kind.BARRIER, Barrier())
