"""Collectives on GPU buffers, for the framework adapters (torch, TensorFlow, JAX).

Adapters describe their tensors as `DeviceBuffer`s and pass the event after which the
inputs are ready (or None when they synchronised). Everything that could make one rank
unable to run the collective is checked here, before negotiation, so that a refusal on
one rank fails the matching call on every rank instead of leaving them inside NCCL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import nccl, reduce, runtime
from .collectives import _name, _submit, check_root
from .cuda import TorchCuda, default_runtime
from .device import DeviceBuffer, nccl_type
from .engine import Handle, Request
from .gpu import device_for_local_rank
from .negotiation import GPU, Kind, Signature
from .ops import ReduceOp, as_op

Finish = Callable[[Any], Any]


def _start(name: str | None, build: Callable[[str], Request]) -> Handle:
    request_name, given = _name(name)
    return _submit(request_name, given, build)


def _request(request_name: str, signature: Signature, **fields: Any) -> Request:
    return Request(request_name, signature, Handle(request_name), **fields)


def check_buffers(buffers: Sequence[DeviceBuffer], what: str) -> None:
    """Raise if this rank's GPU plane cannot take `buffers` (no NCCL, no GPU, wrong GPU,
    a type NCCL lacks)."""
    nccl.load()
    expected = device_for_local_rank(runtime.local_rank(), default_runtime().device_count())
    for buffer in buffers:
        nccl_type(buffer.code)
        if buffer.device != expected:
            raise ValueError(
                f"{what}: a tensor is on GPU {buffer.device}, but rank {runtime.rank()} (local "
                f"rank {runtime.local_rank()}) uses GPU {expected} for NCCL. Put the model and "
                f"data on cuda:{expected} (e.g. torch.cuda.set_device(local_rank()))."
            )


def _check_scaling(op: ReduceOp, prescale: float, postscale: float) -> None:
    sums = op in (ReduceOp.SUM, ReduceOp.AVERAGE)
    scaled = (prescale, postscale) != (1.0, 1.0)
    if not sums and scaled and not isinstance(default_runtime(), TorchCuda):
        raise NotImplementedError(
            "scale factors with op=Min, Max or Product need torch on the GPU; use "
            "op=Sum or Average, or scale the tensors yourself."
        )


def allreduce_async(
    sends: Sequence[DeviceBuffer],
    outs: Sequence[DeviceBuffer],
    shapes: Sequence[tuple[int, ...]],
    op: ReduceOp | str,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    ready: Any = None,
    finish: Finish | None = None,
) -> Handle:
    """Start one allreduce of one or more GPU buffers of one dtype, `sends[i]` into
    `outs[i]` (the same memory for in place)."""

    def build(request_name: str) -> Request:
        if not sends:
            raise ValueError("allreduce needs at least one tensor.")
        code = sends[0].code
        if any(buffer.code is not code for buffer in [*sends, *outs]):
            raise TypeError("a grouped allreduce needs tensors of one dtype; group them by dtype.")
        check_buffers([*sends, *outs], "allreduce")
        reduce_op = as_op(op)
        pre, post = float(prescale_factor), float(postscale_factor)
        reduce.check_op(reduce_op, code, pre, post)
        _check_scaling(reduce_op, pre, post)
        total = sum(buffer.count for buffer in sends)
        shape, parts = (tuple(shapes[0]), ()) if len(sends) == 1 else ((total,), tuple(shapes))
        return _request(
            request_name,
            Signature(Kind.ALLREDUCE, code, reduce_op, -1, shape, parts, GPU),
            sends=list(sends),
            outs=list(outs),
            prescale=pre,
            postscale=post,
            ready=ready,
            finish=finish,
        )

    return _start(name, build)


def broadcast_async(
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
        return _request(
            request_name,
            Signature(Kind.BROADCAST, buffer.code, -1, root, tuple(shape), (), GPU, refuse_joined),
            send=buffer,
            out=buffer,
            ready=ready,
            finish=finish,
        )

    return _start(name, build)


def allgather_async(
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
        return _request(
            request_name,
            Signature(Kind.ALLGATHER, send.code, -1, -1, rows[1:], (), GPU, refuse_joined),
            extra=rows[0],
            send=send,
            out=out,
            ready=ready,
            finish=finish,
        )

    return _start(name, build)


def reducescatter_async(
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
        _check_scaling(reduce_op, pre, post)
        return _request(
            request_name,
            Signature(Kind.REDUCESCATTER, send.code, reduce_op, -1, tuple(shape), (), GPU),
            send=send,
            prescale=pre,
            postscale=post,
            ready=ready,
            finish=finish,
        )

    return _start(name, build)
