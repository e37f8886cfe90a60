"""The collectives users call: `ringplug.allreduce(array)`, `ringplug.broadcast(...)`, ...

They take numpy arrays or anything with the buffer protocol, on every rank of the job.
Each rank must make the same calls in the same order: when shapes, dtypes, ops or roots
differ between ranks, every rank raises `ringplug.MismatchError` saying who passed what.
Bad arguments on one rank raise there and raise `PeerArgumentError` on the others; no
rank is left waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import runtime
from .communicator import Kind
from .dtypes import DType, classify, storage_view
from .ops import Average, ReduceOp, as_op

ArrayLike = Any  # numpy arrays and anything with the buffer protocol


def _as_array(obj: ArrayLike) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        raise TypeError(
            f"ringplug collectives take numpy arrays or buffer-protocol objects, got "
            f"{type(obj).__name__}. Framework tensors go through ringplug.torch / ringplug.keras."
        ) from None


def _prepare(kind: Kind, array: ArrayLike, dtype: str | DType | None, name: str | None):
    """View `array` in its storage type, contiguous; on bad input fail on every rank."""
    comm = runtime.world()
    try:
        source = _as_array(array)
        code = classify(source, dtype)
    except TypeError as exc:
        comm.reject(kind, name, exc)
        raise AssertionError("unreachable") from exc
    send = storage_view(source, code)
    return comm, source, code, send if send.flags.c_contiguous else np.ascontiguousarray(send)


def allreduce(
    array: ArrayLike,
    op: ReduceOp | str = Average,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    out: np.ndarray | None = None,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> np.ndarray:
    """Combine `array` from every rank elementwise with `op`; every rank gets the result.

    Args:
        array: the same shape and dtype on every rank.
        op: `ringplug.Average` (default), `Sum`, `Min`, `Max` or `Product`.
        prescale_factor: multiply each rank's input by this first (floating types).
        postscale_factor: multiply the result by this (floating types).
        out: where to write the result (same shape and dtype); `out=array` works in place.
        name: a label for error messages.
        dtype: reinterpret the buffer, e.g. ``"bfloat16"`` for raw 16-bit words.

    Returns:
        `out`, or a new array.

    Example:
        >>> import numpy as np, ringplug
        >>> ringplug.init()
        >>> ringplug.allreduce(np.ones(3, np.float32), op=ringplug.Sum)  # doctest: +SKIP
        array([2., 2., 2.], dtype=float32)   # on 2 ranks
    """
    comm, source, code, send = _prepare(Kind.ALLREDUCE, array, dtype, name)
    try:
        reduce_op = as_op(op)
        if out is None:
            out = np.empty_like(source)
        elif out is not source and (
            not isinstance(out, np.ndarray)
            or out.shape != source.shape
            or out.dtype != source.dtype
        ):
            raise ValueError(
                f"out must be an array of shape {source.shape} and dtype {source.dtype}."
            )
    except (TypeError, ValueError) as exc:
        comm.reject(Kind.ALLREDUCE, name, exc)
        raise AssertionError("unreachable") from exc
    target = send if out is source and send is source else storage_view(out, code)
    contiguous = target.flags.c_contiguous
    work = target if contiguous else np.empty(target.shape, target.dtype)
    comm.allreduce(send, work, reduce_op, code, prescale_factor, postscale_factor, name)
    if not contiguous:
        target[...] = work
    return out


def allgather(
    array: ArrayLike, *, name: str | None = None, dtype: str | DType | None = None
) -> np.ndarray:
    """Concatenate `array` from every rank along the first dimension, in rank order.

    The first dimension may differ between ranks; the other dimensions and the dtype
    must match. A 0-d array counts as one row.
    """
    comm, source, code, send = _prepare(Kind.ALLGATHER, array, dtype, name)
    gathered = comm.allgather(send.reshape(1) if send.ndim == 0 else send, code, name)
    return gathered.view(source.dtype) if gathered.dtype != source.dtype else gathered


def broadcast(
    array: ArrayLike,
    root_rank: int = 0,
    *,
    out: np.ndarray | None = None,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> np.ndarray:
    """Every rank gets root's `array` (same shape and dtype on every rank).

    Returns a new array, or writes into `out` (``out=array`` broadcasts in place).
    """
    comm, source, code, send = _prepare(Kind.BROADCAST, array, dtype, name)
    try:
        result = send.copy() if out is None else out
        if result.shape != source.shape or storage_view(result, code).dtype != send.dtype:
            raise ValueError(
                f"out must be an array of shape {source.shape} and dtype {source.dtype}."
            )
    except (TypeError, ValueError) as exc:
        comm.reject(Kind.BROADCAST, name, exc)
        raise AssertionError("unreachable") from exc
    target = storage_view(result, code)
    work = target if target.flags.c_contiguous else np.ascontiguousarray(target)
    if out is not None and work.ctypes.data != send.ctypes.data:
        work[...] = send
    comm.broadcast(work, int(root_rank), code, name)
    if work is not target:
        target[...] = work
    return result.view(source.dtype) if out is None and result.dtype != source.dtype else result


def reducescatter(
    array: ArrayLike,
    op: ReduceOp | str = Average,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> np.ndarray:
    """Reduce `array` over ranks and give each rank its block of rows of the result.

    The first dimension is split as evenly as possible: with R rows and N ranks, rank r
    gets R // N rows, and the first R % N ranks one more.
    """
    comm, source, code, send = _prepare(Kind.REDUCESCATTER, array, dtype, name)
    try:
        reduce_op = as_op(op)
    except ValueError as exc:
        comm.reject(Kind.REDUCESCATTER, name, exc)
        raise AssertionError("unreachable") from exc
    block = comm.reducescatter(
        send, reduce_op, code, float(prescale_factor), float(postscale_factor), name
    )
    return block.view(source.dtype) if block.dtype != source.dtype else block


def alltoall(
    array: ArrayLike,
    splits: Sequence[int] | np.ndarray | None = None,
    *,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Send rows `splits[i]` of `array` to rank i; return what each rank sent here.

    Without `splits` the first dimension is split evenly (it must divide by the number
    of ranks). Returns the received rows concatenated in rank order, and the number of
    rows received from each rank.
    """
    comm, source, code, send = _prepare(Kind.ALLTOALL, array, dtype, name)
    received, rows = comm.alltoall(send, splits, code, name)
    return (received.view(source.dtype) if received.dtype != source.dtype else received), rows


def barrier(name: str | None = None) -> None:
    """Wait until every rank has called barrier."""
    runtime.world().barrier(name)


def broadcast_object(obj: Any = None, root_rank: int = 0, *, name: str | None = None) -> Any:
    """Root's picklable `obj` on every rank (other ranks' `obj` is ignored)."""
    return runtime.world().broadcast_object(obj, int(root_rank), name)


def allgather_object(obj: Any, *, name: str | None = None) -> list[Any]:
    """A list of every rank's picklable `obj`, in rank order."""
    return runtime.world().allgather_object(obj, name)
