"""The collectives users call: `ringplug.allreduce(array)`, `ringplug.allreduce_async(...)`, ...

They take numpy arrays or anything with the buffer protocol. Each has an async form that
returns a `Handle` at once; the plain form is the async form followed by `wait()`. Every
rank must submit the same collectives: matched by `name`, or, for unnamed calls, by the
order of the calls (they get the names "noname.1", "noname.2", ... on every rank). When
shapes, dtypes, ops or roots differ between ranks, every rank's handle raises
`ringplug.MismatchError` saying who passed what. Bad arguments on one rank raise there and
raise `PeerArgumentError` on the others; no rank is left waiting.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from . import reduce, ring, runtime
from .dtypes import DType, classify, storage_view
from .engine import Handle, Request, cacheable_name
from .errors import RingplugError
from .negotiation import CACHEABLE, Kind, Signature
from .ops import Average, ReduceOp, as_op

ArrayLike = Any  # numpy arrays and anything with the buffer protocol


def _name(name: str | None) -> tuple[str, bool]:
    """The request's name, and whether to cache it (see `engine.cacheable_name`)."""
    if name is not None:
        return str(name), cacheable_name(str(name))
    return runtime.engine().unnamed(), False


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


def _contiguous(array: np.ndarray, code: DType) -> np.ndarray:
    view = storage_view(array, code)
    return view if view.flags.c_contiguous else np.ascontiguousarray(view)


def _submit(name: str, cacheable: bool, build) -> Handle:
    """Build the request with `build(name)`; on bad arguments submit an error marker under
    the same name, so that every other rank's handle fails instead of waiting."""
    engine = runtime.engine()
    try:
        request = build(name)
    except (TypeError, ValueError, NotImplementedError, RingplugError) as exc:
        # RingplugError: e.g. no NCCL or no GPU for a GPU tensor on this rank
        marker = Request(name, Signature(Kind.ERROR), Handle(name), error=exc)
        return engine.submit(marker)
    request.cacheable = cacheable and request.signature.kind in CACHEABLE
    return engine.submit(request)


def reject(error: BaseException, name: str | None = None) -> NoReturn:
    """Fail this call with `error` here, and the matching call on every other rank with
    `PeerArgumentError`, instead of leaving them waiting (for framework adapters)."""

    def build(_: str) -> Request:
        raise error

    request_name, _ = _name(name)
    _submit(request_name, False, build).wait()
    raise error


def check_root(root_rank: int) -> int:
    """`root_rank` as an int, or ValueError when it is not a rank of this job."""
    root, size = int(root_rank), runtime.size()
    if not 0 <= root < size:
        raise ValueError(f"root_rank={root} is not a rank of this job (ranks are 0..{size - 1}).")
    return root


def _result_as(source: np.ndarray, result: np.ndarray) -> np.ndarray:
    return result.view(source.dtype) if result.dtype != source.dtype else result


# ---------------------------------------------------------------------- allreduce
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
    request_name, given = _name(name)

    def build(request_name: str) -> Request:
        source = _as_array(array)
        code = classify(source, dtype)
        reduce_op = as_op(op)
        reduce.check_op(reduce_op, code, float(prescale_factor), float(postscale_factor))
        target = np.empty_like(source) if out is None else out
        if target is not source and (
            not isinstance(target, np.ndarray)
            or target.shape != source.shape
            or target.dtype != source.dtype
        ):
            raise ValueError(
                f"out must be an array of shape {source.shape} and dtype {source.dtype}."
            )
        send = _contiguous(source, code)
        view = storage_view(target, code)
        work = view if view.flags.c_contiguous else np.empty(view.shape, view.dtype)

        def finish(result: np.ndarray) -> np.ndarray:
            if work is not view:
                view[...] = work
            return target

        return Request(
            request_name,
            Signature(Kind.ALLREDUCE, code, reduce_op, -1, source.shape),
            Handle(request_name),
            sends=[send.reshape(-1)],
            outs=[work.reshape(-1)],
            in_place=work.ctypes.data == send.ctypes.data,
            prescale=float(prescale_factor),
            postscale=float(postscale_factor),
            finish=finish,
        )

    return _submit(request_name, given, build)


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
    return allreduce_async(
        array, op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        out=out, name=name, dtype=dtype,
    ).wait()  # fmt: skip


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
        sources = [_as_array(array) for array in arrays]
        if not sources:
            raise ValueError("grouped_allreduce needs at least one array.")
        code = classify(sources[0], dtype)
        if any(source.dtype != sources[0].dtype for source in sources):
            raise TypeError("grouped_allreduce needs arrays of one dtype; group them by dtype.")
        reduce_op = as_op(op)
        reduce.check_op(reduce_op, code, float(prescale_factor), float(postscale_factor))
        sends = [_contiguous(source, code).reshape(-1) for source in sources]
        if out is None:
            # The results are views of one buffer, so the engine reduces the group there.
            span: np.ndarray | None = np.empty(sum(send.size for send in sends), sends[0].dtype)
            outs = ring.split(span, [send.size for send in sends])
            targets = [o.reshape(s.shape) for s, o in zip(sources, outs, strict=True)]
        else:
            span, targets = None, list(out)
            if len(targets) != len(sources) or any(
                not isinstance(t, np.ndarray) or t.shape != s.shape or t.dtype != s.dtype
                or not t.flags.c_contiguous for t, s in zip(targets, sources, strict=False)
            ):  # fmt: skip
                raise ValueError("out must hold one C-contiguous array per input, of the "
                                 "input's shape and dtype.")  # fmt: skip
            outs = [storage_view(t, code).reshape(-1) for t in targets]
        in_place = all(o.ctypes.data == s.ctypes.data for o, s in zip(outs, sends, strict=True))

        def finish(result: Any) -> list[np.ndarray]:
            return [_result_as(source, target)
                    for source, target in zip(sources, targets, strict=True)]  # fmt: skip

        return Request(
            request_name,
            Signature(Kind.ALLREDUCE, code, reduce_op, -1, (sum(send.size for send in sends),),
                      tuple(source.shape for source in sources)),
            Handle(request_name), sends=sends, outs=outs, span=span, in_place=in_place,
            prescale=float(prescale_factor), postscale=float(postscale_factor), finish=finish,
        )  # fmt: skip

    request_name, given = _name(name)
    return _submit(request_name, given, build)


def grouped_allreduce(
    arrays: Sequence[ArrayLike],
    op: ReduceOp | str = Average,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    out: Sequence[np.ndarray] | None = None,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> list[np.ndarray]:
    """Allreduce several arrays in one negotiation and one fused pass; returns the results
    (new arrays, or ``out``: ``out=arrays`` reduces them in place)."""
    return grouped_allreduce_async(
        arrays, op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        out=out, name=name, dtype=dtype,
    ).wait()  # fmt: skip


def allgather_async(
    array: ArrayLike, *, name: str | None = None, dtype: str | DType | None = None,
    refuse_joined: bool = False,
) -> Handle:  # fmt: skip
    """Start an allgather; the handle's `wait()` returns what `allgather` returns.

    With `refuse_joined`, it fails on every rank if a rank has joined (Horovod's join
    semantics) instead of gathering no rows from that rank."""

    def build(request_name: str) -> Request:
        source = _as_array(array)
        code = classify(source, dtype)
        send = _contiguous(source.reshape(1) if source.ndim == 0 else source, code)
        return Request(
            request_name, Signature(Kind.ALLGATHER, code, -1, -1, tuple(send.shape[1:]),
                                    refuse_joined=refuse_joined),
            Handle(request_name), extra=send.shape[0], send=send,
            finish=lambda result: _result_as(source, result),
        )  # fmt: skip

    request_name, given = _name(name)
    return _submit(request_name, given, build)


def allgather(array: ArrayLike, *, name: str | None = None,
              dtype: str | DType | None = None) -> np.ndarray:  # fmt: skip
    """Concatenate `array` from every rank along the first dimension, in rank order.

    The first dimension may differ between ranks; the other dimensions and the dtype
    must match. A 0-d array counts as one row.
    """
    return allgather_async(array, name=name, dtype=dtype).wait()


# ---------------------------------------------------------------------- broadcast
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
        source = _as_array(array)
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
            request_name, Signature(Kind.BROADCAST, code, -1, root, tuple(source.shape),
                                    refuse_joined=refuse_joined),
            Handle(request_name), send=work, out=work, finish=finish,
        )  # fmt: skip

    request_name, given = _name(name)
    return _submit(request_name, given, build)


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
    return broadcast_async(array, root_rank, out=out, name=name, dtype=dtype).wait()


# ---------------------------------------------------------------------- reducescatter
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
        source = _as_array(array)
        code = classify(source, dtype)
        reduce_op = as_op(op)
        if source.ndim == 0:
            raise ValueError("reducescatter needs an array with at least one dimension to split.")
        reduce.check_op(reduce_op, code, float(prescale_factor), float(postscale_factor))
        return Request(
            request_name,
            Signature(Kind.REDUCESCATTER, code, reduce_op, -1, tuple(source.shape)),
            Handle(request_name), send=_contiguous(source, code),
            prescale=float(prescale_factor), postscale=float(postscale_factor),
            finish=lambda result: _result_as(source, result),
        )  # fmt: skip

    request_name, given = _name(name)
    return _submit(request_name, given, build)


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
    return reducescatter_async(
        array, op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        name=name, dtype=dtype,
    ).wait()  # fmt: skip


# ---------------------------------------------------------------------- alltoall
def alltoall_async(
    array: ArrayLike,
    splits: Sequence[int] | np.ndarray | None = None,
    *,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> Handle:
    """Start an alltoall; the handle's `wait()` returns what `alltoall` returns."""

    def build(request_name: str) -> Request:
        source = _as_array(array)
        code = classify(source, dtype)
        if source.ndim == 0:
            raise ValueError("alltoall needs an array with at least one dimension.")
        rows = _alltoall_rows(source.shape[0], splits, runtime.size())
        return Request(
            request_name, Signature(Kind.ALLTOALL, code, -1, -1, tuple(source.shape[1:])),
            Handle(request_name), extra=source.shape[0], send=_contiguous(source, code),
            splits=rows, finish=lambda result: (_result_as(source, result[0]), result[1]),
        )  # fmt: skip

    request_name, given = _name(name)
    return _submit(request_name, given, build)


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
    return alltoall_async(array, splits, name=name, dtype=dtype).wait()


def _alltoall_rows(first: int, splits: Sequence[int] | np.ndarray | None, size: int) -> np.ndarray:
    if splits is None:
        if first % size:
            raise ValueError(
                f"alltoall without splits divides the first dimension ({first}) evenly over "
                f"{size} ranks; pass splits= to send uneven blocks."
            )
        return np.full(size, first // size, np.int64)
    rows = np.asarray(splits, dtype=np.int64).reshape(-1)
    if rows.size != size or (rows < 0).any() or rows.sum() != first:
        raise ValueError(
            f"alltoall splits must be {size} non-negative row counts summing to the first "
            f"dimension ({first}); got {list(map(int, rows))}."
        )
    return rows


# ---------------------------------------------------------------------- the rest
def barrier_async(name: str | None = None) -> Handle:
    """Start a barrier; the handle is done once every rank has called it."""
    request_name, _ = _name(name)
    return _submit(request_name, False, lambda n: Request(n, Signature(Kind.BARRIER), Handle(n)))


def barrier(name: str | None = None) -> None:
    """Wait until every rank has called barrier."""
    barrier_async(name).wait()


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
            request_name, Signature(Kind.BROADCAST_OBJECT, -1, -1, root), Handle(request_name),
            extra=len(data), data=data,
            finish=lambda raw: obj if mine else pickle.loads(raw),
        )  # fmt: skip

    request_name, given = _name(name)
    return _submit(request_name, given, build).wait()


def allgather_object(obj: Any, *, name: str | None = None) -> list[Any]:
    """A list of every rank's picklable `obj`, in rank order."""

    def build(request_name: str) -> Request:
        data = _pickled(obj)
        return Request(
            request_name, Signature(Kind.ALLGATHER_OBJECT), Handle(request_name),
            extra=len(data), data=data,
            finish=lambda parts: [pickle.loads(part) for part in parts],
        )  # fmt: skip

    request_name, given = _name(name)
    return _submit(request_name, given, build).wait()


def poll(handle: Handle) -> bool:
    """Whether the collective behind `handle` has finished; never blocks."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for the collective behind `handle`; return its result or raise its error."""
    return handle.wait()


def join() -> int:
    """Declare that this rank has run out of data, and wait until every rank has.

    Until then this rank takes part in the other ranks' collectives with a contribution
    that changes nothing (zeros for Sum and Average, which still divides by the full
    number of ranks; +inf/-inf/1 for Min/Max/Product). Returns the rank that joined last,
    the same on every rank.
    """
    return runtime.engine().join().wait()


def start_timeline(path: str) -> None:
    """Start writing a Chrome trace of the engine to `path` (rank 0 writes it)."""
    runtime.engine().start_timeline(path)


def stop_timeline() -> None:
    """Finish the timeline file (it is valid JSON from then on)."""
    runtime.engine().stop_timeline()
