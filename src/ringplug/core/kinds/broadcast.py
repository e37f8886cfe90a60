"""Broadcast: root's array on every rank."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...wire import GPU, Kind, Response, Signature
from ..dtypes import DType, classify, storage_view
from ..engine.handles import Handle, Request
from ..gpu.device import DeviceBuffer
from .base import (
    ArrayLike,
    Finish,
    as_array,
    blocking,
    check_buffers,
    check_root,
    make,
    start,
)
from .kind import Buffer, CollectiveKind, EngineView, SameEverywhere, register


def broadcast_async(
    array: ArrayLike,
    root_rank: int = 0,
    *,
    out: np.ndarray | None = None,
    name: str | None = None,
    dtype: str | DType | None = None,
    refuse_joined: bool = False,
) -> Handle:
    """Start a broadcast; the handle's `wait()` returns what `broadcast` returns.

    With `refuse_joined`, it fails on every rank if a rank has joined (Horovod's join
    semantics), even when the root has not."""

    def build(request_name: str) -> Request:
        source = as_array(array)
        code = classify(source, dtype)
        root = check_root(root_rank)
        target = np.array(source, copy=True) if out is None else out
        if target.shape != source.shape or target.dtype != source.dtype:
            raise ValueError(
                f"out must be an array of shape {source.shape} and dtype {source.dtype}."
            )
        view = storage_view(target, code)
        work = view if view.flags.c_contiguous else np.ascontiguousarray(view)
        if out is not None and target is not source:
            work[...] = storage_view(source, code)

        def finish(result: np.ndarray) -> np.ndarray:
            if work is not view:
                view[...] = work
            return target

        return Request(
            request_name,
            Signature(
                Kind.BROADCAST, code, -1, root, tuple(source.shape), refuse_joined=refuse_joined
            ),
            Handle(request_name),
            Buffer(work, work),
            finish=finish,
        )

    return start(name, build)


broadcast = blocking(
    broadcast_async,
    np.ndarray,
    """Every rank gets root's `array` (same shape and dtype on every rank).

    Returns a new array, or writes into `out` (``out=array`` broadcasts in place).
    """,
)


def gpu_broadcast_async(
    buffer: DeviceBuffer,
    shape: tuple[int, ...],
    root_rank: int = 0,
    *,
    name: str | None = None,
    ready: Any = None,
    finish: Finish | None = None,
    refuse_joined: bool = False,
) -> Handle:
    """Start overwriting `buffer` with root's, in place (`refuse_joined`: as the host's)."""

    def build(request_name: str) -> Request:
        check_buffers([buffer], "broadcast")
        root = check_root(root_rank)
        return make(
            request_name,
            Signature(Kind.BROADCAST, buffer.code, -1, root, tuple(shape), (), GPU, refuse_joined),
            payload=Buffer(buffer, buffer, ready=ready),
            finish=finish,
        )

    return start(name, build)


class Broadcast(CollectiveKind):
    label = "broadcast"
    cacheable = True

    def run_host(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        signature = response.signature
        _check_root_present(response)
        if request is not None:
            buf = request.payload.out
        else:
            buf = np.empty(signature.shape, DType(signature.code).storage)
        engine.transport.broadcast(buf, signature.root)
        return buf

    def run_gpu(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        signature = response.signature
        _check_root_present(response)
        count = math.prod(signature.shape)
        return engine.gpu_plane().broadcast(
            request.payload.out if request else None,
            count,
            DType(signature.code),
            signature.root,
            request.payload.ready if request is not None else None,
        )


def _check_root_present(response: Response) -> None:
    root = response.signature.root
    if not response.have[root]:
        raise SameEverywhere(
            f"broadcast {response.name!r}: root rank {root} has joined and has nothing to send."
        )


register(Kind.BROADCAST, Broadcast())
