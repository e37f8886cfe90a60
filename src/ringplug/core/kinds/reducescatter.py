"""Reducescatter: the reduction over ranks, each rank keeping its block of rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...wire import GPU, Kind, Response, Signature
from ..dtypes import DType, classify
from ..engine.handles import Handle, Request
from ..gpu.device import DeviceBuffer
from ..ops import Average, ReduceOp, as_op
from ..transport import reduce
from .base import (
    ArrayLike,
    Finish,
    as_array,
    blocking,
    check_buffers,
    check_scaling,
    contiguous,
    in_place_arrays,
    make,
    result_as,
    start,
)
from .kind import Buffer, CollectiveKind, EngineView, identity, register


def reducescatter_async(
    array: ArrayLike,
    op: ReduceOp | str = Average,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> Handle:
    """Start a reducescatter; the handle's `wait()` returns what `reducescatter` returns."""

    def build(request_name: str) -> Request:
        source = as_array(array)
        code = classify(source, dtype)
        reduce_op = as_op(op)
        if source.ndim == 0:
            raise ValueError("reducescatter needs an array with at least one dimension to split.")
        reduce.check_op(reduce_op, code, float(prescale_factor), float(postscale_factor))
        return Request(
            request_name,
            Signature(Kind.REDUCESCATTER, code, reduce_op, -1, tuple(source.shape)),
            Handle(request_name),
            Buffer(
                contiguous(source, code),
                prescale=float(prescale_factor),
                postscale=float(postscale_factor),
            ),
            finish=lambda result: result_as(source, result),
        )

    return start(name, build)


reducescatter = blocking(
    reducescatter_async,
    np.ndarray,
    """Reduce `array` over ranks and give each rank its block of rows of the result.

    The first dimension is split as evenly as possible: with R rows and N ranks, rank r
    gets R // N rows, and the first R % N ranks one more.
    """,
)


def reducescatter_in_place_async(
    arrays: Sequence[ArrayLike],
    counts: Sequence[int],
    op: ReduceOp | str = Average,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> Handle:
    """Start a reducescatter into blocks of any length, in the caller's own memory.

    `arrays` (flat, contiguous, one dtype, host memory) are read as one concatenation, cut
    into consecutive blocks of `counts[r]` elements for rank r (the counts add up to the
    total and are the same on every rank). Once the handle is done, rank r's block of the
    arrays holds the reduction over ranks (scaled); every other element holds a partial
    result, so the caller must own them and not need them (sharded gradients: the rest is
    dropped). Neither a copy of the input nor padding to equal blocks; the ring moves each
    block once. `wait()` returns None.
    """

    def build(request_name: str) -> Request:
        flat, code, blocks = in_place_arrays(arrays, counts, dtype, "reducescatter_in_place")
        total = sum(blocks)
        reduce_op = as_op(op)
        pre, post = float(prescale_factor), float(postscale_factor)
        reduce.check_op(reduce_op, code, pre, post)
        return make(
            request_name,
            Signature(
                Kind.REDUCESCATTER, code, reduce_op, -1, (total,), tuple((c,) for c in blocks)
            ),
            payload=Buffer(flat, prescale=pre, postscale=post),
        )

    return start(name, build)


def gpu_reducescatter_async(
    send: DeviceBuffer,
    shape: tuple[int, ...],
    op: ReduceOp | str,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    ready: Any = None,
    finish: Finish | None = None,
) -> Handle:
    """Start a reducescatter: this rank gets its block of rows of the reduction."""

    def build(request_name: str) -> Request:
        check_buffers([send], "reducescatter")
        if not shape:
            raise ValueError("reducescatter needs a tensor with at least one dimension.")
        reduce_op = as_op(op)
        pre, post = float(prescale_factor), float(postscale_factor)
        reduce.check_op(reduce_op, send.code, pre, post)
        check_scaling(reduce_op, pre, post)
        return make(
            request_name,
            Signature(Kind.REDUCESCATTER, send.code, reduce_op, -1, tuple(shape), (), GPU),
            payload=Buffer(send, prescale=pre, postscale=post, ready=ready),
            finish=finish,
        )

    return start(name, build)


class Reducescatter(CollectiveKind):
    label = "reducescatter"
    cacheable = True

    def run_host(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        signature = response.signature
        op, code = ReduceOp(signature.op), DType(signature.code)
        if signature.parts:  # reducescatter_in_place: the block of each rank in `parts`
            return self._run_in_place(engine, signature, op, code, request)
        if request is not None:
            send = request.payload.send
        else:  # joined: values that change nothing
            send = np.full(signature.shape, identity(op, code), code.storage)
        block = engine.transport.reducescatter(
            send, op, code, request.payload.prescale if request else 1.0
        )
        if request is not None:
            average = op is ReduceOp.AVERAGE
            factor = (
                request.payload.postscale / engine.size if average else request.payload.postscale
            )
            reduce.scale(block.reshape(-1), factor, code)
        return block

    def _run_in_place(
        self,
        engine: EngineView,
        signature: Signature,
        op: ReduceOp,
        code: DType,
        request: Request | None,
    ) -> None:
        if request is not None:
            arrays, pre, post = (
                request.payload.send,
                request.payload.prescale,
                request.payload.postscale,
            )
        else:  # joined: values that change nothing, reduced in a scratch buffer
            arrays = [np.full(signature.shape, identity(op, code), code.storage)]
            pre, post = 1.0, 1.0
        if op is ReduceOp.AVERAGE:
            post /= engine.size
        counts = [part[0] for part in signature.parts]
        engine.transport.reducescatter_in_place(arrays, counts, op, code, pre, post)

    def run_gpu(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        signature = response.signature
        op, code = ReduceOp(signature.op), DType(signature.code)
        count = math.prod(signature.shape)
        row_elems = math.prod(signature.shape[1:])
        send = request.payload.send if request else np.full(count, identity(op, code), code.storage)
        return engine.gpu_plane().reducescatter(
            send,
            signature.shape[0],
            row_elems,
            code,
            op,
            request.payload.prescale if request else 1.0,
            request.payload.postscale if request else 1.0,
            request.payload.ready if request is not None else None,
        )


register(Kind.REDUCESCATTER, Reducescatter())
