"""The requests of an allreduce: host arrays (one call, or a group in one pass) and GPU
buffers, and their blocking forms.

Every host request is made by `_request`, whose fast path takes the usual call (a
C-contiguous numpy array of a native type, reduced in place or into a new array, valid
arguments) without the general checks. A blocking call submits its request as one its
caller waits for at once: the engine's scheduler decides whether the caller runs its cycle
(`engine.scheduler`), and the cycle whether its negotiation takes the fast path
(`engine.cycle`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ....wire import GPU, HOST, UNNAMED, Kind, Signature, cacheable_name
from ... import runtime
from ...dtypes import FLOATING, DType, classify, storage_view
from ...engine.handles import Handle, Request
from ...gpu.device import DeviceBuffer
from ...ops import Average, ReduceOp, as_op
from ...transport import reduce, ring
from ..base import (
    ArrayLike,
    Finish,
    as_array,
    blocking,
    check_buffers,
    check_scaling,
    contiguous,
    make,
    result_as,
    start,
    waited_at_once,
    waited_at_once_now,
)
from .fusion import Reduction

# (op, type, postscale) of a plain call (see `_plain`).
Plain = tuple[ReduceOp, DType, float]


def allreduce_async(
    array: ArrayLike,
    op: ReduceOp | str = Average,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    out: np.ndarray | None = None,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> Handle:
    """Start an allreduce; the handle's `wait()` returns what `allreduce` returns.

    Don't touch `array` or `out` until the handle is done.
    """
    return _submit(
        array, op, prescale_factor, postscale_factor, out, name, dtype, waited_at_once_now()
    )


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
        name: matches this call across ranks (and names it in errors and the timeline).
        dtype: reinterpret the buffer, e.g. ``"bfloat16"`` for raw 16-bit words.

    Returns:
        `out`, or a new array.

    Example:
        >>> import numpy as np, ringplug
        >>> ringplug.init()
        >>> ringplug.allreduce(np.ones(3, np.float32), op=ringplug.Sum)  # doctest: +SKIP
        array([2., 2., 2.], dtype=float32)   # on 2 ranks
    """
    handle = _submit(array, op, prescale_factor, postscale_factor, out, name, dtype, True)
    return handle.wait()


def _submit(
    array: ArrayLike,
    op: ReduceOp | str,
    prescale_factor: float,
    postscale_factor: float,
    out: np.ndarray | None,
    name: str | None,
    dtype: str | DType | None,
    waits: bool,
) -> Handle:
    """Submit the request of `allreduce_async`'s arguments (`_request`); `waits`: its caller
    waits for it at once (see `Scheduler.submit`). Arguments that may be wrong go through
    `start`, which tells the other ranks when they are."""
    engine = runtime.current_engine()
    plain = _plain(array, op, prescale_factor, postscale_factor, out, dtype)
    if engine is None or plain is None:
        build = lambda request_name: _request(  # noqa: E731
            request_name, array, op, prescale_factor, postscale_factor, out, dtype
        )
        if not waits:
            return start(name, build)
        with waited_at_once():
            return start(name, build)
    if name is None:  # `name_request`, written out: this runs every call
        number = next(engine.unnamed_numbers)
        request = _plain_request(f"{UNNAMED}{number}", array, out is None, *plain)
        request.number = number
    else:
        request = _plain_request(str(name), array, out is None, *plain)
        request.cacheable = cacheable_name(request.name)
    return engine.scheduler.submit(request, waits)


def _request(
    name: str,
    array: ArrayLike,
    op: ReduceOp | str,
    prescale_factor: float,
    postscale_factor: float,
    out: np.ndarray | None,
    dtype: str | DType | None,
    plain: Plain | None = None,
) -> Request:
    """The request of `allreduce_async`'s arguments, checked; `plain` (see `_plain`): they
    are the plain case, which needs none of the checks and conversions."""
    if plain is not None:
        return _plain_request(name, array, out is None, *plain)
    source = as_array(array)
    code = classify(source, dtype)
    reduce_op = as_op(op)
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    reduce.check_op(reduce_op, code, prescale, postscale)
    target = np.empty_like(source) if out is None else out
    if target is not source and (
        not isinstance(target, np.ndarray)
        or target.shape != source.shape
        or target.dtype != source.dtype
    ):
        raise ValueError(f"out must be an array of shape {source.shape} and dtype {source.dtype}.")
    send = contiguous(source, code)
    view = storage_view(target, code)
    work = view if view.flags.c_contiguous else np.empty(view.shape, view.dtype)
    # Signature and Reduction take every argument by position: this runs once per
    # asynchronous call, and keywords with defaults cost them twice their time.
    return Request(
        name,
        Signature(Kind.ALLREDUCE, code, reduce_op, -1, source.shape, (), HOST, False),
        Handle(name),
        Reduction(
            [send if send.ndim == 1 else send.reshape(-1)],
            [work if work.ndim == 1 else work.reshape(-1)],
            # a new array (out=None) never shares the input's memory: no address to read
            work is send or (out is not None and work.ctypes.data == send.ctypes.data),
            None,
            prescale,
            postscale,
        ),
        finish=None if work is view else _copy_back(work, view, target),
        result=target,
    )


def _plain_request(
    name: str, array: np.ndarray, fresh: bool, op: ReduceOp, code: DType, postscale: float
) -> Request:
    """`_request`'s fast path: `array` reduced in place, or into a new array when `fresh`."""
    send = array if array.ndim == 1 else array.reshape(-1)
    result = np.empty_like(array) if fresh else array
    out = (result if result.ndim == 1 else result.reshape(-1)) if fresh else send
    if code is DType.BFLOAT16:  # ml_dtypes' type: the only plain one stored as another
        send, out = storage_view(send, code), storage_view(out, code)
    # `plain_signature`, written out: this runs every call
    signature = _PLAIN_SIGNATURES.get((code, op, array.shape)) or plain_signature(
        code, op, array.shape
    )
    # By position (name, signature, handle, payload, cacheable, extra, error, finish,
    # result): keywords cost a dataclass's `__init__` more.
    return Request(
        name,
        signature,
        Handle(name),
        Reduction([send], [out], not fresh, None, 1.0, postscale),
        False,
        0,
        None,
        None,
        result,
    )


def _plain(
    array: ArrayLike,
    op: ReduceOp | str,
    prescale_factor: float,
    postscale_factor: float,
    out: np.ndarray | None,
    dtype: str | DType | None,
) -> Plain | None:
    """(op, type, postscale) when the arguments are the plain case that needs none of the
    usual path's conversions: a C-contiguous numpy array of a native type, reduced in place
    or into a new array, no prescale, valid arguments; else None (the usual path checks
    them, says what is wrong and tells the other ranks)."""
    if not (
        type(array) is np.ndarray
        and (out is None or out is array)
        and dtype is None
        and isinstance(prescale_factor, (int, float))
        and prescale_factor == 1.0
    ):
        return None
    try:
        reduce_op, code, postscale = as_op(op), classify(array), float(postscale_factor)
    except Exception:  # noqa: BLE001 - the usual path raises it, and tells the other ranks
        return None
    # `in FLOATING`, not the enum's `is_floating` property, a Python call each time
    if not (code in FLOATING or (reduce_op is not ReduceOp.AVERAGE and postscale == 1.0)):
        return None
    if not array.flags.c_contiguous:
        return None
    return reduce_op, code, postscale


# The signatures of plain requests by (type, op, shape): a training step submits the same
# few forms every step, and a signature made anew is a noticeable part of a submission.
# Signatures are immutable, so requests share them; the dictionary is emptied when it has
# this many (shapes that change every step).
_PLAIN_SIGNATURES: dict[tuple[DType, ReduceOp, tuple[int, ...]], Signature] = {}
_PLAIN_SIGNATURES_KEPT = 4096


def plain_signature(code: DType, op: ReduceOp, shape: tuple[int, ...]) -> Signature:
    """The signature of a plain host allreduce, shared by every request of that form."""
    form = (code, op, shape)
    signature = _PLAIN_SIGNATURES.get(form)
    if signature is None:
        if len(_PLAIN_SIGNATURES) >= _PLAIN_SIGNATURES_KEPT:
            _PLAIN_SIGNATURES.clear()
        signature = _PLAIN_SIGNATURES[form] = Signature(
            Kind.ALLREDUCE, code, op, -1, shape, (), HOST, False
        )
    return signature


def flat(array: np.ndarray) -> np.ndarray:
    """`array` (C-contiguous) as one dimension, itself when it has one already."""
    return array if array.ndim == 1 else array.reshape(-1)


def _copy_back(work: np.ndarray, view: np.ndarray, target: np.ndarray) -> Finish:
    """The `finish` of an allreduce reduced in a contiguous copy (`work`) of an output that
    is not contiguous: copy the result into the output's `view` and return `target`."""

    def finish(_: Any) -> np.ndarray:
        view[...] = work
        return target

    return finish


def grouped_allreduce_async(
    arrays: Sequence[ArrayLike],
    op: ReduceOp | str = Average,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    out: Sequence[np.ndarray] | None = None,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> Handle:
    """Start one allreduce of several arrays; `wait()` returns the list of results.

    The group is negotiated as one request and reduced in one fused pass: the cheapest way
    to reduce many small tensors. Arrays must share a dtype. With ``out=arrays`` the group is
    reduced in place, where the arrays lie (the ring reads and writes them directly: no
    fusion buffer, no copy); otherwise the results are views of one new buffer.
    """

    def build(request_name: str) -> Request:
        sources = [as_array(array) for array in arrays]
        if not sources:
            raise ValueError("grouped_allreduce needs at least one array.")
        code = classify(sources[0], dtype)
        if any(source.dtype != sources[0].dtype for source in sources):
            raise TypeError("grouped_allreduce needs arrays of one dtype; group them by dtype.")
        reduce_op = as_op(op)
        reduce.check_op(reduce_op, code, float(prescale_factor), float(postscale_factor))
        sends = [flat(contiguous(source, code)) for source in sources]
        if out is None:
            # The results are views of one buffer, so the engine reduces the group there.
            span: np.ndarray | None = np.empty(sum(send.size for send in sends), sends[0].dtype)
            outs = ring.split(span, [send.size for send in sends])
            targets = [o.reshape(s.shape) for s, o in zip(sources, outs, strict=True)]
            in_place = False  # a new buffer
        else:
            span, targets = None, list(out)
            if len(targets) != len(sources) or any(
                not isinstance(t, np.ndarray)
                or t.shape != s.shape
                or t.dtype != s.dtype
                or not t.flags.c_contiguous
                for t, s in zip(targets, sources, strict=False)
            ):
                raise ValueError(
                    "out must hold one C-contiguous array per input, of the "
                    "input's shape and dtype."
                )
            outs = [flat(storage_view(t, code)) for t in targets]
            # `out=arrays` (C-contiguous, so `sends` are views of them) is in place; other
            # outputs are compared by address, which costs a ctypes call an array.
            in_place = all(t is s for t, s in zip(targets, sources, strict=True)) or all(
                o.ctypes.data == s.ctypes.data for o, s in zip(outs, sends, strict=True)
            )

        def finish(result: Any) -> list[np.ndarray]:
            if targets[0].dtype == sources[0].dtype:  # as every other's (one dtype each)
                return targets
            return [
                result_as(source, target) for source, target in zip(sources, targets, strict=True)
            ]

        return Request(
            request_name,
            Signature(
                Kind.ALLREDUCE,
                code,
                reduce_op,
                -1,
                (sum(send.size for send in sends),),
                tuple(source.shape for source in sources),
            ),
            Handle(request_name),
            Reduction(sends, outs, in_place, span, float(prescale_factor), float(postscale_factor)),
            finish=finish,
        )

    return start(name, build)


grouped_allreduce = blocking(
    grouped_allreduce_async,
    list[np.ndarray],
    """Allreduce several arrays in one negotiation and one fused pass; returns the results
    (new arrays, or ``out``: ``out=arrays`` reduces them in place).""",
)


def gpu_allreduce_async(
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
        check_scaling(reduce_op, pre, post)
        total = sum(buffer.count for buffer in sends)
        shape, parts = (tuple(shapes[0]), ()) if len(sends) == 1 else ((total,), tuple(shapes))
        return make(
            request_name,
            Signature(Kind.ALLREDUCE, code, reduce_op, -1, shape, parts, GPU),
            payload=Reduction(list(sends), list(outs), prescale=pre, postscale=post, ready=ready),
            finish=finish,
        )

    return start(name, build)
