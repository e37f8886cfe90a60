"""Allreduce in fused batches: the plan's consecutive allreduces of one dtype, op and place
are reduced in one collective.

Large batches are reduced where the tensors lie (the ring takes several arrays as one
range); small ones, which MPI's own Allreduce handles best, are packed into one persistent
fusion buffer (up to `RINGPLUG_FUSION_THRESHOLD` bytes) first. Tensors that already lie side
by side in one buffer (a gradient bucket, a grouped allreduce's result) are reduced there
either way. On the GPU the same batch goes to NCCL with a fusion buffer on the device.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ....config import Settings
from ....wire import GPU, Response
from ...algorithms import ALLREDUCE, RING
from ...dtypes import BY_CODE, DType
from ...errors import CommunicatorFailed
from ...ops import BY_CODE as OP_BY_CODE
from ...ops import ReduceOp
from ...transport import reduce, ring
from ..kind import EngineView, identity
from . import eager

if TYPE_CHECKING:
    from ...engine.handles import Request
    from ...timeline import Timeline


@dataclasses.dataclass(eq=False, slots=True)
class Reduction:
    """An allreduce request's payload: `sends[i]` is reduced into `outs[i]` (the same memory
    when `in_place`); a grouped allreduce has several. `span` is one flat array whose
    consecutive views are the outs, when they lie side by side; `ready` the GPU event."""

    sends: list[Any]
    outs: list[Any]
    in_place: bool = False
    span: np.ndarray | None = None
    prescale: float = 1.0
    postscale: float = 1.0
    ready: Any = None

    def factor(self, op: ReduceOp, size: int) -> float:
        """What the reduced values are multiplied by (see `result_factor`)."""
        return result_factor(op, self.postscale, size)


def result_factor(op: ReduceOp, postscale: float, size: int) -> float:
    """What an allreduce's reduced values are multiplied by: `postscale`, over `size` ranks
    for Average (which the wire sums)."""
    return postscale / size if op is ReduceOp.AVERAGE else postscale


# The ring reduces a batch where its tensors lie when they average at least a ring segment
# over this (64 KiB of the default 512 KiB); smaller ones are packed into the fusion
# buffer first: each tensor in place travels as messages of its own, which costs more than
# the copy below that size (figures: docs/benchmarks.md, "Design measurements").
_PIECES_PER_SEGMENT = 8


class Fusion:
    """Runs the fused allreduce batches of one engine, with its reused fusion buffer."""

    def __init__(self, engine: EngineView, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self._buffer = np.empty(0, np.uint8)

    def run(self, batch: list[Response]) -> None:
        """Reduce the tensors of `batch` (same dtype and op) in one collective.

        Large batches are reduced where the tensors lie (the ring sends several arrays as
        one range); small ones, which MPI's own Allreduce handles best, are packed into the
        fusion buffer first. Tensors that already sit side by side in one buffer are
        reduced there either way.
        """
        engine = self.engine
        signature = batch[0].signature
        code, op = BY_CODE[signature.code], OP_BY_CODE[signature.op]
        pending = engine.pending
        requests = (
            [pending.pop(batch[0].name, None)]
            if len(batch) == 1
            else [pending.pop(r.name, None) for r in batch]
        )
        if signature.place == GPU:
            self._gpu(batch, requests, code, op)
            return
        copies = engine.carried_copies
        if copies:
            only = requests[0] if len(batch) == 1 else None
            views = copies.get(batch[0].name) if only is not None else None
            if views is not None:  # a synchronous call's usual small batch
                reduce_carried(engine, only, views)  # type: ignore[arg-type]
                engine.transport.last_path = "eager"
                engine.counters.collectives_run += 1
                return
            batch, requests = self._eager(batch, requests, code, op)
            if not batch:
                engine.counters.collectives_run += 1
                return
        skipped = engine.begin_collective("allreduce", batch)
        if skipped is not None:
            engine.complete_each(requests, error=skipped)
            return
        try:
            only = requests[0] if len(requests) == 1 else None
            if only is not None and len(only.payload.sends) == 1:
                self._one(only, code, op)  # a synchronous call's usual batch
            else:
                self._host(batch, requests, code, op)
        except CommunicatorFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or peers hang
            engine.collective_failed(exc, requests)

    def _eager(
        self, batch: list[Response], requests: list[Request | None], code: DType, op: ReduceOp
    ) -> tuple[list[Response], list[Request | None]]:
        """Reduce the requests of `batch` whose data every rank's message carried (see
        `eager`); returns the rest of the batch, for the transport."""
        copies = self.engine.carried_copies
        rest: list[Response] = []
        rest_requests: list[Request | None] = []
        for response, request in zip(batch, requests, strict=True):
            views = copies.get(response.name) if request is not None else None
            if views is None:
                rest.append(response)
                rest_requests.append(request)
            else:
                reduce_carried(self.engine, request, views)  # type: ignore[arg-type]
        if len(rest) < len(batch):
            self.engine.transport.last_path = "eager"
        return rest, rest_requests

    def _host(
        self, batch: list[Response], requests: list[Request | None], code: DType, op: ReduceOp
    ) -> None:
        engine = self.engine
        # Per tensor, side by side: its request (None for a joined rank's part), input and
        # output (parallel lists, not a tuple per tensor: a burst has a thousand).
        owners: list[Request | None] = []
        sends: list[np.ndarray] = []
        outs: list[np.ndarray] = []
        for response, request in zip(batch, requests, strict=True):
            if request is not None:
                reduction = request.payload
                if len(reduction.sends) == 1:  # the usual request: one array
                    owners.append(request)
                    sends.append(reduction.sends[0])
                    outs.append(reduction.outs[0])
                else:
                    owners.extend([request] * len(reduction.sends))
                    sends.extend(reduction.sends)
                    outs.extend(reduction.outs)
            else:
                parts = joined_parts(response, op, code)
                owners.extend([None] * len(parts))
                sends.extend(parts)
                outs.extend(parts)
        sizes = [send.size for send in sends]
        total = sum(sizes)
        start = time.perf_counter()
        packed = False
        present = [request for request in requests if request is not None]
        in_place = all(request.payload.in_place for request in present)
        span = None
        if len(requests) == 1 and present and present[0].payload.span is not None:
            span = present[0].payload.span  # a grouped allreduce's result buffer
        elif len(present) == len(requests) and in_place:
            span = side_by_side(outs, code)  # e.g. a gradient buffer
        if span is not None:
            # The outputs lie side by side in one buffer: reduce there, after one copy in
            # unless the tensors are reduced in place.
            target: np.ndarray | ring.Pieces = span
            parts = outs
            if not in_place:
                np.concatenate(sends, out=span)
        elif len(sends) == 1 or (
            engine.transport.choose(ALLREDUCE, total * code.itemsize, code, op) == RING
            and total * code.itemsize * _PIECES_PER_SEGMENT
            >= len(sends) * self.settings.ring_segment
        ):
            for request, send, out in zip(owners, sends, outs, strict=True):
                if request is not None and not request.payload.in_place:
                    np.copyto(out, send)
            parts = outs
            target = parts[0] if len(parts) == 1 else ring.Pieces(parts)
        else:
            packed = True
            target = self._view(code, total)
            np.concatenate(sends, out=target)
            parts = ring.split(target, sizes)
        if any(request.payload.prescale != 1.0 for request in present):
            for request, part in zip(owners, parts, strict=True):
                if request is not None and request.payload.prescale != 1.0:
                    reduce.scale(part, request.payload.prescale, code)
        copied_in = time.perf_counter()
        postscales = {request.payload.postscale for request in present}
        # One factor for the whole batch (the usual case) is applied inside the reduction,
        # with no pass of its own over the result.
        shared = 1.0
        if len(postscales) == 1:
            shared = result_factor(op, next(iter(postscales)), engine.size)
        engine.transport.allreduce(target, op, code, postscale=shared)
        reduced = time.perf_counter()
        engine.counters.collectives_run += 1
        if packed:
            for request, out, part in zip(owners, outs, parts, strict=True):
                if request is not None:
                    out[...] = part
        if len(postscales) > 1:  # each request's own factor
            for request, out in zip(owners, outs, strict=True):
                if request is not None:
                    factor = request.payload.factor(op, engine.size)
                    if factor != 1.0:
                        reduce.scale(out, factor, code)
        copied_out = time.perf_counter()
        engine.complete_each(requests)
        timeline = engine.timeline
        if timeline is not None:
            self._trace(
                timeline, requests, len(batch), (start, copied_in, reduced, copied_out), packed
            )

    def _one(self, request: Request, code: DType, op: ReduceOp) -> None:
        """`_host` for a batch of one request of one array (a synchronous call's usual
        shape): reduced where its output lies, its factor applied inside the reduction."""
        engine = self.engine
        reduction = request.payload
        out = reduction.outs[0]
        timeline = engine.timeline
        start = time.perf_counter() if timeline is not None else 0.0
        if not reduction.in_place:
            np.copyto(out, reduction.sends[0])
        if reduction.prescale != 1.0:
            reduce.scale(out, reduction.prescale, code)
        copied_in = time.perf_counter() if timeline is not None else 0.0
        factor = result_factor(op, reduction.postscale, engine.size)
        engine.transport.allreduce(out, op, code, postscale=factor)
        engine.counters.collectives_run += 1
        engine.complete(request)
        if timeline is not None:
            reduced = time.perf_counter()
            self._trace(timeline, [request], 1, (start, copied_in, reduced, reduced), packed=False)

    def _trace(
        self,
        timeline: Timeline,
        requests: list[Request | None],
        fused: int,
        times: tuple[float, float, float, float],
        packed: bool,
    ) -> None:
        """The timeline's spans of a host batch: its wait, the copy in, the reduction
        and the copy out (`times`: start, copied in, reduced, copied out)."""
        engine = self.engine
        start, copied_in, reduced, copied_out = times
        for request in requests:
            if request is None:
                continue
            engine.trace_wait(timeline, request, start)
            if copied_in - start > 1e-6:
                timeline.span(request.name, "COPY_IN", start, copied_in)
            timeline.span(
                request.name,
                "ALLREDUCE",
                copied_in,
                reduced,
                fused=fused,
                path=engine.transport.last_path,
            )
            if packed:
                timeline.span(request.name, "COPY_OUT", reduced, copied_out)

    def _gpu(
        self, batch: list[Response], requests: list[Request | None], code: DType, op: ReduceOp
    ) -> None:
        """The GPU form of `_allreduce_batch`: NCCL, with the fusion buffer on the device."""
        engine = self.engine
        items: list[tuple[Any, Any, float, float]] = []
        for response, request in zip(batch, requests, strict=True):
            if request is None:  # joined: identity values from the host
                items.extend((part, None, 1.0, 1.0) for part in joined_parts(response, op, code))
                continue
            pairs = zip(request.payload.sends, request.payload.outs, strict=True)
            items.extend(
                (send, out, request.payload.prescale, request.payload.postscale)
                for send, out in pairs
            )
        start = time.perf_counter()
        try:
            engine.gpu_plane().allreduce(items, code, op, [r.payload.ready for r in requests if r])
        except CommunicatorFailed as exc:  # these requests left _pending: fail them here
            engine.complete_each(requests, error=exc)
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. out of device memory for the fusion buffer
            # Its callers hear it; peers inside the NCCL collective end at the GPU plane's
            # timeout, which aborts the communicator on every rank.
            engine.complete_each(requests, error=exc)
            return
        done = time.perf_counter()
        engine.counters.collectives_run += 1
        engine.complete_each(requests)
        timeline = engine.timeline
        if timeline is not None:
            for request in requests:
                if request is not None:
                    engine.trace_wait(timeline, request, start)
                    timeline.span(request.name, "NCCL_ALLREDUCE", start, done, fused=len(batch))

    def _view(self, code: DType, count: int) -> np.ndarray:
        nbytes = count * code.itemsize
        if self._buffer.nbytes < nbytes:
            # Grows to the largest batch seen (at most the fusion threshold) and is reused.
            self._buffer = np.empty(
                max(nbytes, min(self.settings.fusion_threshold, 4 * nbytes)), np.uint8
            )
        return self._buffer[:nbytes].view(code.storage)


def joined_parts(response: Response, op: ReduceOp, code: DType) -> list[np.ndarray]:
    """What a joined rank contributes to an allreduce: identity values, one flat array per
    tensor of the request."""
    shapes = response.signature.parts or (response.signature.shape,)
    return [np.full(math.prod(shape), identity(op, code), code.storage) for shape in shapes]


def side_by_side(arrays: list[np.ndarray], code: DType) -> np.ndarray | None:
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


def reduce_carried(
    engine: EngineView,
    request: Request,
    copies: Sequence[bytes | bytearray | memoryview],
    offset: int = 0,
) -> None:
    """Complete `request` with every rank's copy of its data (`copies`, in rank order,
    from byte `offset` on), reduced here as on every rank (see `eager`). The allreduce
    kind's `run_carried` itself, and what `Fusion` does with a batch's carried copies."""
    signature = request.signature
    code, op = BY_CODE[signature.code], OP_BY_CODE[signature.op]
    timeline = engine.timeline
    start = time.perf_counter() if timeline is not None else 0.0
    reduction = request.payload
    try:
        # `result_factor`, written out: a synchronous call's usual path, where each
        # Python call counts
        outs = reduction.outs
        eager.reduce_into(outs, copies, op, code, offset)
        factor = reduction.postscale
        if op is ReduceOp.AVERAGE:
            factor /= engine.size
        if factor != 1.0:
            for out in outs:
                reduce.scale(out, factor, code)
    except Exception as exc:  # noqa: BLE001 - the same on every rank: fail it here
        engine.complete(request, error=exc)
        return
    engine.complete(request)
    if timeline is not None:
        engine.trace_wait(timeline, request, start)
        timeline.span(request.name, "ALLREDUCE", start, time.perf_counter(), path="eager")
