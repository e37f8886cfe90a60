"""Picklable objects: `broadcast_object` (root's object everywhere) and `allgather_object`
(a list of every rank's)."""

from __future__ import annotations

import pickle
from typing import Any

from ...wire import Kind, Response, Signature
from .. import runtime
from ..engine.handles import Handle, Request
from .base import (
    name_request,
    submit_and_wait,
)
from .kind import CollectiveKind, EngineView, SameEverywhere, register


def _pickled(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the caller's bad input
        raise TypeError(f"Cannot pickle {type(obj).__name__} to send it: {exc}") from exc


def broadcast_object(obj: Any = None, root_rank: int = 0, *, name: str | None = None) -> Any:
    """Root's picklable `obj` on every rank (other ranks' `obj` is ignored)."""
    root = int(root_rank)

    def build(request_name: str) -> Request:
        size = runtime.size()
        if not 0 <= root < size:
            raise ValueError(
                f"root_rank={root} is not a rank of this job (ranks are 0..{size - 1})."
            )
        mine = runtime.rank() == root
        data = _pickled(obj) if mine else b""
        return Request(
            request_name,
            Signature(Kind.BROADCAST_OBJECT, -1, -1, root),
            Handle(request_name),
            data,
            extra=len(data),
            finish=lambda raw: obj if mine else pickle.loads(raw),
        )

    request_name, given = name_request(name)
    return submit_and_wait(request_name, given, build)


def allgather_object(obj: Any, *, name: str | None = None) -> list[Any]:
    """A list of every rank's picklable `obj`, in rank order."""

    def build(request_name: str) -> Request:
        data = _pickled(obj)
        return Request(
            request_name,
            Signature(Kind.ALLGATHER_OBJECT),
            Handle(request_name),
            data,
            extra=len(data),
            finish=lambda parts: [pickle.loads(part) for part in parts],
        )

    request_name, given = name_request(name)
    return submit_and_wait(request_name, given, build)


class BroadcastObject(CollectiveKind):
    label = "broadcast_object"

    def run_host(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        root = response.signature.root
        if not response.have[root]:
            raise SameEverywhere(
                f"broadcast_object {response.name!r}: root rank {root} has joined."
            )
        data = request.payload if request is not None else b""
        return engine.transport.broadcast_bytes(data, response.extras[root], root)


class AllgatherObject(CollectiveKind):
    label = "allgather_object"

    def run_host(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        data = request.payload if request is not None else b""
        return engine.transport.allgather_bytes(data, response.extras)


class InvalidArguments(CollectiveKind):
    """The marker a rank submits when it rejected its own arguments (`Kind.ERROR`)."""

    label = "invalid arguments"

    def describe(self, signature: Signature) -> str:
        return "invalid arguments (its own error says why)"


register(Kind.BROADCAST_OBJECT, BroadcastObject())
register(Kind.ALLGATHER_OBJECT, AllgatherObject())
register(Kind.ERROR, InvalidArguments())
