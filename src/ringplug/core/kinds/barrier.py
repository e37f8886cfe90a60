"""Barrier: done once every rank has called it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..handles import Handle, Request
from ..kind import CollectiveKind, register
from ..negotiation import Kind, Signature
from .base import (
    blocking,
    name_request,
    submit,
)

if TYPE_CHECKING:
    from ..engine import Engine
    from ..negotiation import Response


def barrier_async(name: str | None = None) -> Handle:
    """Start a barrier; the handle is done once every rank has called it."""
    request_name, _ = name_request(name)
    return submit(request_name, False, lambda n: Request(n, Signature(Kind.BARRIER), Handle(n)))


barrier = blocking(barrier_async, None, """Wait until every rank has called barrier.""")


class Barrier(CollectiveKind):
    """Negotiation itself is the barrier: once every rank has it ready, it is done."""

    label = "barrier"

    def run_host(self, engine: Engine, response: Response, request: Request | None) -> Any:
        return None


register(Kind.BARRIER, Barrier())
