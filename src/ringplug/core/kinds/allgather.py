"""Allgather: every rank's rows, concatenated in rank order (the first dimension may
differ between ranks)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...wire import GPU, Kind, Response, Signature
from ..dtypes import DType, classify
from ..engine.handles import Handle, Request
from ..gpu.device import DeviceBuffer
from .base import (
    ArrayLike,
    Finish,
    as_array,
    blocking,
    check_buffers,
    contiguous,
    in_place_arrays,
    make,
    result_as,
    start,
)
from .kind import Buffer, CollectiveKind, EngineView, register, shape_text


def allgather_async(
    array: ArrayLike,
    *,
    name: str | None = None,
    dtype: str | DType | None = None,
    refuse_joined: bool = False,
) -> Handle:
    """Start an allgather; the handle's `wait()` returns what `allgather` returns.

    With `refuse_joined`, it fails on every rank if a rank has joined (Horovod's join
    semantics) instead of gathering no rows from that rank."""

    def build(request_name: str) -> Request:
        source = as_array(array)
        code = classify(source, dtype)
        send = contiguous(source.reshape(1) if source.ndim == 0 else source, code)
        return Request(
            request_name,
            Signature(
                Kind.ALLGATHER, code, -1, -1, tuple(send.shape[1:]), refuse_joined=refuse_joined
            ),
            Handle(request_name),
            Buffer(send),
            extra=send.shape[0],
            finish=lambda result: result_as(source, result),
        )

    return start(name, build)


allgather = blocking(
    allgather_async,
    np.ndarray,
    """Concatenate `array` from every rank along the first dimension, in rank order.

    The first dimension may differ between ranks; the other dimensions and the dtype
    must match. A 0-d array counts as one row.
    """,
)


def allgather_in_place_async(
    arrays: Sequence[ArrayLike],
    counts: Sequence[int],
    *,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> Handle:
    """Start an allgather into the caller's own memory, of blocks of any length.

    `arrays` (flat, contiguous, one dtype, host memory, laid out alike on every rank) are
    read as one concatenation, cut into consecutive blocks of `counts[r]` elements for rank
    r (the same counts on every rank, adding up to the total). Once the handle is done,
    every rank's arrays hold every rank's block: its own is sent, the others are written
    over. Neither a staging copy nor a result buffer (sharded weights gathered straight into
    the parameters). `wait()` returns None.
    """

    def build(request_name: str) -> Request:
        flat, code, blocks = in_place_arrays(arrays, counts, dtype, "allgather_in_place")
        return make(
            request_name,
            Signature(Kind.ALLGATHER, code, -1, -1, (sum(blocks),), tuple((c,) for c in blocks)),
            payload=Buffer(flat),
        )

    return start(name, build)


def gpu_allgather_async(
    send: DeviceBuffer,
    shape: tuple[int, ...],
    *,
    name: str | None = None,
    ready: Any = None,
    out: DeviceBuffer | None = None,
    finish: Finish | None = None,
    refuse_joined: bool = False,
) -> Handle:
    """Start an allgather of `send` (rows = shape[0], which may differ between ranks); the
    result is `out`, or new device memory when `out` is None (`refuse_joined`: as the
    host's)."""

    def build(request_name: str) -> Request:
        check_buffers([send] if out is None else [send, out], "allgather")
        rows = tuple(shape) if shape else (1,)
        return make(
            request_name,
            Signature(Kind.ALLGATHER, send.code, -1, -1, rows[1:], (), GPU, refuse_joined),
            payload=Buffer(send, out, ready=ready),
            extra=rows[0],
            finish=finish,
        )

    return start(name, build)


class Allgather(CollectiveKind):
    label = "allgather"

    def shape_text(self, signature: Signature) -> str:
        return f"with rows of shape {shape_text(signature.shape)}"

    def run_host(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        signature = response.signature
        if signature.parts:  # allgather_in_place: the block of each rank in `parts`
            if request is not None:
                arrays = request.payload.send
            else:  # joined: zeros for its block
                arrays = [np.zeros(signature.shape, DType(signature.code).storage)]
            engine.transport.allgather_in_place(arrays, [part[0] for part in signature.parts])
            return None
        if request is not None:
            send = request.payload.send
        else:  # joined: no rows from this rank
            send = np.empty((0, *signature.shape), DType(signature.code).storage)
        return engine.transport.allgather(send, response.extras)

    def run_gpu(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        signature = response.signature
        row_elems = math.prod(signature.shape)
        send, out, ready = (
            (request.payload.send, request.payload.out, request.payload.ready)
            if request is not None
            else (None, None, None)
        )
        return engine.gpu_plane().allgather(
            send, response.extras, row_elems, DType(signature.code), ready, out
        )


register(Kind.ALLGATHER, Allgather())
