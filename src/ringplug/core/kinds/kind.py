"""What every kind of collective provides, and the registry the engine dispatches through.

A kind is one object (a module or package of `ringplug.core.kinds` makes and registers it):
how it describes itself in errors and the timeline, how it runs on host buffers and on the
GPU, whether it runs in fused batches, whether small requests of it travel inside the
negotiation message, and what a rank that has joined contributes. Its request builders live
beside it. The engine knows no kind by name: it asks `kind_of(signature.kind)`, and a kind
sees the engine only through `EngineView`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...wire import GPU, Response, Signature
from ..dtypes import DType
from ..errors import PeerFailedError, RingplugError
from ..ops import ReduceOp

if TYPE_CHECKING:
    from ...config import Settings
    from ..engine.counters import Counters
    from ..engine.handles import Request
    from ..gpu.plane import GpuPlane
    from ..timeline import Timeline
    from ..transport.host import Transport

__all__ = [
    "Buffer",
    "CollectiveKind",
    "EngineView",
    "SameEverywhere",
    "check_joined",
    "identity",
    "KINDS",
    "kind_of",
    "register",
    "shape_text",
]


class EngineView(Protocol):
    """What a kind may use of the engine that runs it (`engine.Engine` is one)."""

    settings: Settings
    rank: int
    size: int
    transport: Transport
    timeline: Timeline | None
    # The engine's counts; a kind adds each collective it runs to `collectives_run`.
    counters: Counters
    # Per-kind state the engine keeps for its kinds (a fusion buffer), by kind label.
    kind_state: dict[str, Any]

    # This rank's requests negotiated and not yet run (a kind pops what it runs).
    pending: dict[str, Request]
    # This cycle's data carried in the messages: name -> every rank's copy.
    carried_copies: dict[str, list[memoryview]]

    def gpu_plane(self) -> GpuPlane: ...

    def begin_collective(self, kind: str, responses: list[Response]) -> PeerFailedError | None: ...

    def collective_failed(self, exc: BaseException, requests: list[Request | None]) -> None: ...

    def complete(
        self, request: Request, result: Any = None, error: BaseException | None = None
    ) -> None: ...

    def complete_each(
        self, requests: list[Request | None], error: BaseException | None = None
    ) -> None: ...

    def trace_wait(self, timeline: Timeline, request: Request, start: float) -> None: ...


@dataclasses.dataclass(eq=False, slots=True)
class Buffer:
    """The payload of a one-buffer collective (broadcast, allgather, reducescatter,
    alltoall): its input, output and factors, and for the GPU the event after which the
    caller's stream has produced the input (or None)."""

    send: Any
    out: Any = None
    prescale: float = 1.0
    postscale: float = 1.0
    splits: np.ndarray | None = None  # alltoall: rows per destination
    ready: Any = None


class SameEverywhere(RingplugError):
    """A collective that cannot run, found from the plan alone: every rank raises it."""


class CollectiveKind:
    """One kind of collective. Subclasses set `label` and override what they support."""

    label = ""
    # Its signature repeats step after step (gradients, buffers): the negotiation cache
    # gives it a slot, so that a repeated request costs a bit, not its name and signature.
    cacheable = False
    # Run in fused batches with its neighbours in the plan (`run_batch`; allreduce's are
    # in `kinds/allreduce/fusion.py`), not one by one through `run_host`/`run_gpu`.
    fused = False

    def shape_text(self, signature: Signature) -> str:
        """The shape part of `describe` ("with shape 4x3")."""
        if signature.code < 0:
            return ""
        return f"with shape {shape_text(signature.shape)}"

    def describe(self, signature: Signature) -> str:
        """The request in words, for mismatch errors: kind, shape, dtype, op, root, place."""
        parts = [self.label, self.shape_text(signature)]
        if signature.code >= 0:
            parts.append(DType(signature.code).label)
        if signature.op >= 0:
            parts.append(f"op={ReduceOp(signature.op).name.lower()}")
        if signature.root >= 0:
            parts.append(f"root_rank={signature.root}")
        parts.append("on the GPU" if signature.place == GPU else "")
        parts.append("refusing joined ranks" if signature.refuse_joined else "")
        return " ".join(p for p in parts if p)

    def run_host(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        """Run on host buffers (`request` is None on a rank that has joined); the result
        goes to the request's `finish`."""
        raise SameEverywhere(f"{self.label} cannot run on host buffers.")

    def run_gpu(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        """Run on GPU buffers through the engine's GPU plane (results stay on the GPU)."""
        raise RingplugError(f"{self.label} is not available for GPU tensors.")

    def run_batch(self, engine: EngineView, batch: list[Response]) -> None:
        """Run `batch` (consecutive requests of this kind, see `fuses_with`) as one
        collective and complete its requests; for `fused` kinds."""
        raise NotImplementedError(f"{self.label} does not run in fused batches.")

    def fuses_with(self, first: Signature, signature: Signature) -> bool:
        """Whether a request of `signature` may join a batch that starts with `first`."""
        return False

    def carried_bytes(self, signature: Signature, threshold: int) -> int:
        """The bytes a request of `signature` carries inside the negotiation message (at
        most `threshold`), or 0 when it runs as a collective of its own."""
        return 0

    def carried_pieces(self, request: Request) -> Sequence[Any]:
        """What the message carries of `request` (see `carried_bytes`): objects whose
        buffers `b"".join` reads as bytes, one after the other."""
        raise NotImplementedError(f"{self.label} carries no data in messages.")

    def run_carried(
        self, engine: EngineView, request: Request, copies: Sequence[Any], offset: int
    ) -> None:
        """Complete `request` from every rank's copy of its carried data (in rank order,
        from byte `offset` of each copy)."""
        raise NotImplementedError(f"{self.label} carries no data in messages.")


_KINDS: dict[int, CollectiveKind] = {}
# The registered kinds by `wire.Kind`: a cycle's fast path looks a known kind up here
# directly (`kind_of`, a Python call, checks that it is known).
KINDS = _KINDS


def register(kind: int, collective: CollectiveKind) -> CollectiveKind:
    """Make `collective` the object of `kind` (a `wire.Kind`)."""
    _KINDS[int(kind)] = collective
    return collective


def kind_of(kind: int) -> CollectiveKind:
    """The registered object of `kind`."""
    try:
        return _KINDS[int(kind)]
    except KeyError:
        raise SameEverywhere(f"unknown collective kind {kind}") from None


def check_joined(signature: Signature, response: Response) -> None:
    """Fail a request that refuses joined ranks when one has joined (on every rank: they
    all see the same response)."""
    if signature.refuse_joined and not all(response.have):
        joined = ", ".join(str(r) for r, has in enumerate(response.have) if not has)
        raise RingplugError(
            f"{kind_of(signature.kind).label} {response.name!r} cannot run while rank(s) "
            f"{joined} have joined (hvd.join()): only allreduce takes part for a joined rank. "
            "Call join() after the last allgather or broadcast."
        )


def identity(op: ReduceOp, code: DType) -> Any:
    """The value a joined rank contributes to a reduction, so that it changes nothing."""
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


def shape_text(shape: tuple[int, ...]) -> str:
    """A shape as errors show it: "(4, 3)", "(5,)", "()"."""
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"
