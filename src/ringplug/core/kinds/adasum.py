"""Adasum: the adaptive summation of every rank's tensors (Horovod's ``op=hvd.Adasum``).

Each tensor's result is the Adasum of the ranks' copies (see `transport.adasum`): their
sum where they are orthogonal, their average where they are parallel, and in between a
combination that keeps a large learning rate stable with many ranks. Consecutive Adasum
requests of one dtype run fused, each tensor with its own dot products and norms. It needs
a power of two ranks; on any other number every rank's call raises at once, before
anything is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...wire import GPU, Kind, Response, Signature
from .. import runtime
from ..dtypes import DType, classify
from ..engine.handles import Handle, Request
from ..errors import RingplugError
from ..transport.adasum import unsupported_size
from .base import ArrayLike, as_array, blocking, contiguous, start
from .kind import Buffer, CollectiveKind, EngineView, register

_TYPES = (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64)


def check_size(size: int | None = None) -> None:
    """Raise NotImplementedError when Adasum cannot run on this job's number of ranks (the
    same on every rank, so every rank raises it and none waits)."""
    why = unsupported_size(runtime.size() if size is None else size)
    if why is not None:
        raise NotImplementedError(why)


def adasum_async(
    array: ArrayLike,
    *,
    out: np.ndarray | None = None,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> Handle:
    """Start the Adasum of `array` over every rank; the handle's `wait()` returns the
    result (`out` when given: `array` itself reduces it in place).

    `array`: float16, float32 or float64, the same shape and dtype on every rank (another
    dtype fails the handle with TypeError here and `PeerArgumentError` on the other ranks;
    a shape or dtype that differs between ranks, `MismatchError` naming the tensor on every
    rank). Raises NotImplementedError on every rank at once, before anything is sent, when
    the number of ranks is not a power of two.
    """
    check_size()

    def build(request_name: str) -> Request:
        source = as_array(array)
        code = classify(source, dtype)
        if code not in _TYPES:
            raise TypeError(
                f"Adasum reduces float16, float32 or float64 tensors, got {code.label}; "
                "cast it first, or use op=Sum or Average."
            )
        if out is not None and (
            out.shape != source.shape
            or out.dtype != source.dtype
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise ValueError(
                "out must be a contiguous, writable array of the shape and dtype reduced."
            )
        send = contiguous(source, code)
        target = out if out is not None else np.empty_like(source, order="C")
        return Request(
            request_name,
            Signature(Kind.ADASUM, code, -1, -1, tuple(source.shape)),
            Handle(request_name),
            Buffer(send, out=target),
            result=target,
        )

    return start(name, build)


adasum = blocking(
    adasum_async,
    np.ndarray,
    """The Adasum of `array` over every rank (see `adasum_async`).""",
)


def grouped_adasum_async(
    arrays: Sequence[ArrayLike],
    *,
    outs: Sequence[np.ndarray | None] | None = None,
    name: str | None = None,
) -> list[Handle]:
    """Start the Adasum of each of `arrays` (each its own tensor: its own dot products and
    norms); they run fused. Returns one handle per array."""
    check_size()
    outs = list(outs) if outs is not None else [None] * len(arrays)
    return [
        adasum_async(array, out=target, name=None if name is None else f"{name}.{index}")
        for index, (array, target) in enumerate(zip(arrays, outs, strict=True))
    ]


class Adasum(CollectiveKind):
    """Consecutive Adasum requests of one dtype run as one fused buffer."""

    label = "adasum"
    cacheable = True
    fused = True

    def fuses_with(self, first: Signature, signature: Signature) -> bool:
        return first.code == signature.code and signature.place != GPU

    def run_batch(self, engine: EngineView, batch: list[Response]) -> None:
        requests = [engine.pending.pop(response.name, None) for response in batch]
        skipped = engine.begin_collective(self.label, batch)
        if skipped is not None:
            engine.complete_each(requests, error=skipped)
            return
        joined = sorted({r for response in batch for r, has in enumerate(response.have) if not has})
        if joined:  # every rank sees the same responses: all fail alike, nothing moved
            engine.complete_each(
                requests,
                error=RingplugError(
                    f"Adasum {batch[0].name!r} cannot run while rank(s) "
                    f"{', '.join(map(str, joined))} have joined (join()): a joined rank has "
                    "no tensor to combine. Call join() after the last Adasum reduction."
                ),
            )
            return
        try:
            self._run(engine, requests)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or peers hang
            engine.collective_failed(exc, requests)
            return
        engine.counters.collectives_run += 1
        engine.complete_each(requests)

    @staticmethod
    def _run(engine: EngineView, requests: list[Request]) -> None:
        sends = [request.payload.send.reshape(-1) for request in requests]
        bounds = [0]
        for send in sends:
            bounds.append(bounds[-1] + send.size)
        work = np.concatenate(sends) if len(sends) > 1 else sends[0].copy()
        engine.transport.adasum(work, bounds)
        for request, lo, hi in zip(requests, bounds, bounds[1:], strict=False):
            out = request.payload.out
            np.copyto(out.reshape(-1), work[lo:hi].view(out.dtype))

    def run_gpu(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        raise RingplugError("Adasum runs on host (CPU) tensors; copy GPU tensors to the CPU.")


register(Kind.ADASUM, Adasum())
