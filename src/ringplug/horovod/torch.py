"""Horovod's ``horovod.torch`` API on ringplug: ``import ringplug.horovod.torch as hvd``.

Same names, signatures and semantics as Horovod 0.28's PyTorch API for what ringplug
supports: the collectives (sync, async, in place, grouped), their autograd, the
broadcast helpers, `DistributedOptimizer`, `Compression`, `SyncBatchNorm` and
``hvd.elastic`` (on ringrun's restarts, `ringplug.horovod.torch_elastic`). What it does
not support raises with the reason: Adasum, process sets other than the global one.

Where Horovod's semantics differ from ``ringplug.torch``'s, this module follows Horovod:
`Average` and scale factors work on integer tensors (scaled in float64, truncated toward
zero), `alltoall` returns only the tensor when no splits are given, `allgather`'s gradient
is the average of the ranks' gradients, and allgather and broadcast fail while a rank has
joined.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import core
from ..core import collectives as _core
from ..core.ops import ReduceOp
from ..torch import collectives as rt
from ..torch import optimizer as _optimizer
from ..torch.state import allgather_object, broadcast_object, broadcast_parameters
from ..torch.sync_batchnorm import SyncBatchNorm
from . import torch_elastic as _torch_elastic
from ._common import *  # noqa: F403 - Horovod's basics, re-exported
from ._common import Average, check_process_set, global_process_set, resolve_op
from ._common import __all__ as _BASICS
from ._torch_state import broadcast_optimizer_state

elastic = _torch_elastic  # Horovod's hvd.elastic


class _NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _FP16Compressor:
    """Sends floating tensors as float16."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """``hvd.Compression.none`` / ``hvd.Compression.fp16``."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


# The names of the asynchronous operations whose handles the program has not synchronized
# (nor seen done with `poll`), per engine and kind: ``(id(engine), "allreduce", name)``.
# As in Horovod, two operations of one kind and name may not be in flight together; here
# "in flight" lasts until the program has seen the first one end, not until the engine ran
# it, so that submitting a name twice fails the same way on every rank whatever the timing.
_unsynchronized: set[tuple[int, str, str]] = set()
_unsynchronized_lock = threading.Lock()


class Handle:
    """An operation in flight, for `poll()` and `synchronize()` (Horovod's handle)."""

    def __init__(self, parts: Any, finish: Callable[[Any], Any] | None = None) -> None:
        self._parts = parts  # one ringplug handle, or a list of them
        self._finish = finish
        self._claim: tuple[int, str, str] | None = None  # its name, until synchronized

    def done(self) -> bool:
        parts = self._parts if isinstance(self._parts, list) else [self._parts]
        if all(part.done() for part in parts):
            self._release()
            return True
        return False

    def _release(self) -> None:
        if self._claim is not None:
            with _unsynchronized_lock:
                _unsynchronized.discard(self._claim)
            self._claim = None

    def wait(self) -> Any:
        try:
            return self._wait()
        finally:
            self._release()

    def _wait(self) -> Any:
        if isinstance(self._parts, list):
            # Wait for every part even when one fails, so none is left in flight.
            results, error = [], None
            for part in self._parts:
                try:
                    results.append(part.wait())
                except Exception as exc:  # noqa: BLE001 - re-raised below
                    error = error or exc
            if error is not None:
                raise error
        else:
            results = self._parts.wait()
        return self._finish(results) if self._finish else results


def _claimed(kind: str, name: str | None, start: Callable[[], Handle]) -> Handle:
    """`start()` the asynchronous `kind` operation named `name`, refusing the name while an
    earlier one of that kind has not been synchronized."""
    if name is None:
        return start()
    key = (id(core.runtime.engine()), kind, name)
    with _unsynchronized_lock:
        if key in _unsynchronized:
            raise ValueError(
                f"hvd.{kind}: an operation named {name!r} is still in flight on rank "
                f"{core.rank()}: synchronize its handle (or poll it until done) before "
                "submitting the same name again, or give each tensor its own name."
            )
        _unsynchronized.add(key)
    try:
        handle = start()
    except BaseException:
        with _unsynchronized_lock:
            _unsynchronized.discard(key)
        raise
    handle._claim = key
    return handle


# ---------------------------------------------------------------------------- scaling
def _is_integer(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and not (
        tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype is torch.bool
    )


def _plan(
    tensor: Any, op: ReduceOp, pre: float, post: float
) -> tuple[ReduceOp, float, float, bool]:
    """(op, prescale, postscale for the core, and whether to scale here instead).

    Integer tensors are scaled here as Horovod does, in float64 and truncated toward zero:
    each rank's values by `pre` before the sum, the sum by `post` (and 1/size for Average)
    after it. The core keeps refusing scale factors on integers for its own callers."""
    if not _is_integer(tensor) or (op is not ReduceOp.AVERAGE and pre == 1.0 and post == 1.0):
        return op, pre, post, False
    if op is ReduceOp.AVERAGE:
        return ReduceOp.SUM, pre, post / core.size(), True
    if op is not ReduceOp.SUM:
        return op, pre, post, False  # Min/Max/Product with factors: the core's error
    return op, pre, post, True


def _scale_integer(tensor: torch.Tensor, factor: float) -> None:
    if factor != 1.0:
        with torch.no_grad():
            tensor.copy_((tensor.to(torch.float64) * factor).to(tensor.dtype))


def _start_allreduce(
    works: list[torch.Tensor],
    op: ReduceOp,
    name: str | None,
    pre: float,
    post: float,
    grouped: bool,
) -> tuple[Any, Callable[[], None]]:
    """Start reducing `works` in place; returns the handle and what to run after it."""
    core_op, pre, post, here = _plan(works[0] if works else None, op, pre, post)
    if here:
        for work in works:
            _scale_integer(work, pre)
        pre = 1.0
        scale_after, post = post, 1.0
    else:
        scale_after = 1.0
    if grouped:
        handle = rt.grouped_allreduce_async_(
            works, core_op, name=name, prescale_factor=pre, postscale_factor=post
        )
    else:
        handle = rt.allreduce_async_(
            works[0], core_op, name=name, prescale_factor=pre, postscale_factor=post
        )

    def after() -> None:
        for work in works:
            _scale_integer(work, scale_after)

    return handle, after


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------- allreduce
def _op(average: bool | None, op: Any, process_set: Any) -> ReduceOp:
    check_process_set(process_set)
    return resolve_op(average, op)


def _allreduce_into(
    tensor: torch.Tensor, op: ReduceOp, name: str | None, pre: float, post: float
) -> Handle:
    handle, after = _start_allreduce([tensor], op, name, pre, post, grouped=False)

    def finish(result: torch.Tensor) -> torch.Tensor:
        after()
        return result

    return Handle(handle, finish)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, name: str | None, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return _allreduce_into(_copy(tensor), op, name, pre, post).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = _allreduce_into(_copy(grad), ctx.op, None, ctx.pre, ctx.post).wait()
        return reduced, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """The reduction of `tensor` over every rank, as a new tensor (differentiable: the
    gradient is reduced the same way)."""
    reduce_op = _op(average, op, process_set)
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        result = _Allreduce.apply(compressed, reduce_op, name, prescale_factor, postscale_factor)
    else:
        result = _allreduce_into(
            _checked_copy(compressed, "allreduce", name),
            reduce_op,
            name,
            prescale_factor,
            postscale_factor,
        ).wait()
    return compression.decompress(result, ctx)


def _checked_copy(tensor: Any, what: str, name: str | None) -> torch.Tensor:
    """A contiguous copy of `tensor`; something that is not a tensor fails on every rank."""
    if not isinstance(tensor, torch.Tensor):
        _core.reject(TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}."), name)
    return _copy(tensor)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `allreduce`; `synchronize(handle)` returns the result (the input is not changed)."""
    return _claimed(
        "allreduce",
        name,
        lambda: _allreduce_into(
            _checked_copy(tensor, "allreduce_async", name),
            _op(average, op, process_set),
            name,
            prescale_factor,
            postscale_factor,
        ),
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """`allreduce` in place; returns `tensor`."""
    return allreduce_async_(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set
    ).wait()


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `allreduce_` (in place); `synchronize(handle)` returns `tensor`."""
    return _claimed(
        "allreduce",
        name,
        lambda: _allreduce_into(
            tensor, _op(average, op, process_set), name, prescale_factor, postscale_factor
        ),
    )


def _grouped_into(
    tensors: list[torch.Tensor], op: ReduceOp, name: str | None, pre: float, post: float
) -> Handle:
    handle, after = _start_allreduce(tensors, op, name, pre, post, grouped=True)

    def finish(results: list[torch.Tensor]) -> list[torch.Tensor]:
        after()
        return results

    return Handle(handle, finish)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, op: ReduceOp, name: str | None, pre: float, post: float, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return tuple(_grouped_into([_copy(t) for t in tensors], op, name, pre, post).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = _grouped_into([_copy(g) for g in grads], ctx.op, None, ctx.pre, ctx.post).wait()
        return (None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """Several tensors reduced as one request; returns new tensors (differentiable)."""
    reduce_op = _op(average, op, process_set)
    packed = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in packed]
    if torch.is_grad_enabled() and any(
        isinstance(c, torch.Tensor) and c.requires_grad for c in compressed
    ):
        results = list(
            _GroupedAllreduce.apply(reduce_op, name, prescale_factor, postscale_factor, *compressed)
        )
    else:
        copies = [_checked_copy(c, "grouped_allreduce", name) for c in compressed]
        results = _grouped_into(copies, reduce_op, name, prescale_factor, postscale_factor).wait()
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, packed, strict=True)]


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `grouped_allreduce`; `synchronize(handle)` returns the new tensors."""

    def start() -> Handle:
        copies = [_checked_copy(t, "grouped_allreduce_async", name) for t in tensors]
        return _grouped_into(
            copies, _op(average, op, process_set), name, prescale_factor, postscale_factor
        )

    return _claimed("grouped_allreduce", name, start)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """`grouped_allreduce` in place; returns `tensors`."""
    return grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    ).wait()


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `grouped_allreduce_` (in place); `synchronize(handle)` returns `tensors`."""
    return _claimed(
        "grouped_allreduce",
        name,
        lambda: _grouped_into(
            list(tensors), _op(average, op, process_set), name, prescale_factor, postscale_factor
        ),
    )


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any, process_set: Any = global_process_set
) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor by gathering every rank's indices and values; returns a
    function that waits and gives the reduced sparse tensor (Horovod's form)."""
    check_process_set(process_set)
    reduce_op = resolve_op(None, op)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError("sparse_allreduce_async reduces with Sum or Average.")
    sparse = tensor.coalesce()
    # Rows of the gathered indices are the nonzeros, so transpose to gather along them.
    indices = rt.allgather_async(sparse.indices().t().contiguous(), name=f"{name}.indices")
    values = rt.allgather_async(sparse.values().contiguous(), name=f"{name}.values")

    def wait() -> torch.Tensor:
        handle = Handle([indices, values])
        gathered_indices, gathered_values = handle.wait()
        if reduce_op is ReduceOp.AVERAGE:
            gathered_values = gathered_values / core.size()
        return torch.sparse_coo_tensor(
            gathered_indices.t(), gathered_values, tensor.size(), check_invariants=True
        )

    return wait


# ---------------------------------------------------------------------------- allgather
def _rows(tensor: torch.Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def _my_rows(grad: torch.Tensor, rows: int) -> torch.Tensor:
    """This rank's rows of an averaged gradient of a gather (row counts exchanged now)."""
    counts = rt.allgather(torch.tensor([rows], dtype=torch.int64)).tolist()
    offset = sum(counts[: core.rank()])
    return grad.narrow(0, offset, rows)


class _Allgather(torch.autograd.Function):
    """allgather whose gradient is this rank's rows of the ranks' averaged gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        ctx.rows, ctx.scalar = _rows(tensor), tensor.dim() == 0
        return _gather_handle(tensor, name).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        averaged = rt.allreduce(grad.contiguous(), ReduceOp.AVERAGE)
        mine = _my_rows(averaged, ctx.rows)
        return (mine.reshape(()) if ctx.scalar else mine), None


def _gather_handle(tensor: Any, name: str | None) -> Any:
    if not isinstance(tensor, torch.Tensor):
        _core.reject(
            TypeError(f"allgather takes a torch.Tensor, got {type(tensor).__name__}."), name
        )
    return rt.allgather_async(tensor, name=name, refuse_joined=True)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """Every rank's `tensor` concatenated on the first dimension (which may differ);
    differentiable (each rank's rows get the average of the ranks' gradients for them)."""
    check_process_set(process_set)
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, name)
    return _gather_handle(tensor, name).wait()


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Start `allgather`; `synchronize(handle)` returns the gathered tensor."""
    check_process_set(process_set)
    return _claimed("allgather", name, lambda: Handle(_gather_handle(tensor, name)))


def _group_names(name: str | None, count: int) -> list[str | None]:
    return [None if name is None else f"{name}.{i}" for i in range(count)]


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows = [_rows(t) for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        return tuple(grouped_allgather_async(list(tensors), name).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        averaged = grouped_allreduce([g.contiguous() for g in grads], op=Average)
        mine = [_my_rows(g, rows) for g, rows in zip(averaged, ctx.rows, strict=True)]
        return (None, *[m.reshape(()) if s else m for m, s in zip(mine, ctx.scalars, strict=True)])


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """`allgather` of several tensors started together; returns the gathered tensors
    (differentiable)."""
    check_process_set(process_set)
    tensors = list(tensors)
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    ):
        return list(_GroupedAllgather.apply(name, *tensors))
    return grouped_allgather_async(tensors, name).wait()


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `grouped_allgather`; `synchronize(handle)` returns the list."""
    check_process_set(process_set)
    tensors = list(tensors)
    return _claimed(
        "grouped_allgather",
        name,
        lambda: Handle(
            [
                _gather_handle(t, n)
                for t, n in zip(tensors, _group_names(name, len(tensors)), strict=True)
            ]
        ),
    )


# ---------------------------------------------------------------------------- broadcast
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ctx.root_rank = root_rank
        return _broadcast_copy(tensor, root_rank, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # As Horovod: the averaged gradient on the root, zero elsewhere.
        reduced = rt.allreduce(grad.contiguous(), ReduceOp.AVERAGE)
        if core.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


def _checked(tensor: Any, what: str, name: str | None) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        _core.reject(TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}."), name)
    return tensor


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Root's `tensor` on every rank, as a new tensor (differentiable, as Horovod)."""
    check_process_set(process_set)
    _checked(tensor, "broadcast", name)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, name)
    return _broadcast_copy(tensor, root_rank, name)


def _broadcast_copy(tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
    return rt.broadcast_async_(_copy(tensor), root_rank, name=name, refuse_joined=True).wait()


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Overwrite `tensor` with root's on every rank; returns `tensor`."""
    check_process_set(process_set)
    return rt.broadcast_async_(
        _checked(tensor, "broadcast_", name), root_rank, name=name, refuse_joined=True
    ).wait()


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `broadcast`; `synchronize(handle)` returns root's tensor (a new one)."""
    check_process_set(process_set)
    copy = _checked_copy(tensor, "broadcast_async", name)
    return _claimed(
        "broadcast",
        name,
        lambda: Handle(rt.broadcast_async_(copy, root_rank, name=name, refuse_joined=True)),
    )


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `broadcast_` (in place); `synchronize(handle)` returns `tensor`."""
    check_process_set(process_set)
    return _claimed(
        "broadcast",
        name,
        lambda: Handle(
            rt.broadcast_async_(
                _checked(tensor, "broadcast_async_", name), root_rank, name=name, refuse_joined=True
            )
        ),
    )


# ---------------------------------------------------------------------------- alltoall
def _alltoall_handle(tensor: Any, splits: Any, name: str | None) -> Handle:
    """Start an alltoall; the handle gives (received rows, int32 rows received per rank)."""
    _checked(tensor, "alltoall", name)
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype is torch.bool:
            _core.reject(
                ValueError(f"alltoall splits must be integers (torch.int32), got {splits.dtype}."),
                name,
            )
        splits = splits.tolist()
    rt._check(tensor, "alltoall", name)
    source = tensor.detach().cpu().contiguous()  # CUDA rows travel through host memory
    array, dtype = rt.as_numpy(source)
    handle = _core.alltoall_async(array, splits, name=name, dtype=dtype)

    def finish(result: Any) -> tuple[torch.Tensor, torch.Tensor]:
        received, counts = result
        rows = rt.from_numpy(received, source).to(tensor.device)
        return rows, torch.as_tensor(counts, dtype=torch.int32)

    return Handle(handle, finish)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None) -> Any:
        received, counts = _alltoall_handle(tensor, splits, name).wait()
        ctx.received = counts
        if splits is None:
            return received
        ctx.mark_non_differentiable(counts)
        return received, counts

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, None, None]:
        # Each row goes back to the rank it came from.
        sent_back, _ = _alltoall_handle(grad.contiguous(), ctx.received, None).wait()
        return sent_back, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Any:
    """Rows ``splits[i]`` of `tensor` to rank i (an even split without `splits`).

    Returns the rows received, concatenated in rank order; with `splits`, a tuple of them
    and the int32 counts received from each rank (as Horovod). Differentiable.
    """
    check_process_set(process_set)
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return _Alltoall.apply(tensor, splits, name)
    received, counts = _alltoall_handle(tensor, splits, name).wait()
    return received if splits is None else (received, counts)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `alltoall`; `synchronize(handle)` returns (received rows, received counts)."""
    check_process_set(process_set)
    return _claimed("alltoall", name, lambda: _alltoall_handle(tensor, splits, name))


# ---------------------------------------------------------------------------- reducescatter
def _reducescatter_handle(
    tensor: Any, op: ReduceOp, name: str | None, pre: float, post: float
) -> Handle:
    _checked(tensor, "reducescatter", name)
    rt._check(tensor, "reducescatter", name)
    work = tensor.detach().contiguous()
    core_op, pre, post, here = _plan(work, op, pre, post)
    scale_after = 1.0
    if here:
        if pre != 1.0:
            work = work.clone()
            _scale_integer(work, pre)
        pre, scale_after, post = 1.0, post, 1.0
    if work.is_cuda:
        # The GPU plane's reducescatter is synchronous; the handle is already done.
        result = rt.reducescatter(work, core_op, name=name)
        if pre != 1.0 or post != 1.0:
            result = result * (pre * post)
        handle: Any = _Done(result)
    else:
        array, dtype = rt.as_numpy(work)
        handle = _core.reducescatter_async(
            array, core_op, name=name, dtype=dtype, prescale_factor=pre, postscale_factor=post
        )

    def finish(result: Any) -> torch.Tensor:
        block = result if isinstance(result, torch.Tensor) else rt.from_numpy(result, work)
        _scale_integer(block, scale_after)
        return block

    return Handle(handle, finish)


class _Done:
    """A finished operation's result, in a handle's shape."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def wait(self) -> Any:
        return self._result


def _reducescatter_grad(grad: torch.Tensor, op: ReduceOp, pre: float, post: float) -> torch.Tensor:
    # Each rank's input reached every rank's block: gather the blocks' gradients back,
    # scaled as the forward pass scaled them (Sum counts every rank once more than Average).
    factor = (core.size() if op is ReduceOp.SUM else 1.0) * pre * post
    return grad * factor if factor != 1.0 else grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, name: str | None, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return _reducescatter_handle(tensor, op, name, pre, post).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        scaled = _reducescatter_grad(grad.contiguous(), ctx.op, ctx.pre, ctx.post)
        return rt.allgather(scaled), None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's block of rows of the reduction (earlier ranks get a row more when the
    rows do not divide); differentiable."""
    check_process_set(process_set)
    reduce_op = resolve_op(None, op)
    compressed, ctx = compression.compress(tensor)
    if (
        isinstance(compressed, torch.Tensor)
        and compressed.requires_grad
        and torch.is_grad_enabled()
    ):
        result = _Reducescatter.apply(
            compressed, reduce_op, name, prescale_factor, postscale_factor
        )
    else:
        result = _reducescatter_handle(
            compressed, reduce_op, name, prescale_factor, postscale_factor
        ).wait()
    return compression.decompress(result, ctx)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `reducescatter`; `synchronize(handle)` returns this rank's block."""
    check_process_set(process_set)
    return _claimed(
        "reducescatter",
        name,
        lambda: _reducescatter_handle(
            tensor, resolve_op(None, op), name, prescale_factor, postscale_factor
        ),
    )


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, op: ReduceOp, name: str | None, pre: float, post: float, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return tuple(_grouped_reducescatter(list(tensors), op, name, pre, post).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        scaled = [_reducescatter_grad(g.contiguous(), ctx.op, ctx.pre, ctx.post) for g in grads]
        return (None, None, None, None, *grouped_allgather_async(scaled).wait())


def _grouped_reducescatter(
    tensors: list[torch.Tensor], op: ReduceOp, name: str | None, pre: float, post: float
) -> Handle:
    parts = [
        _reducescatter_handle(t, op, n, pre, post)
        for t, n in zip(tensors, _group_names(name, len(tensors)), strict=True)
    ]
    return Handle(parts)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """`reducescatter` of several tensors started together; returns this rank's blocks
    (differentiable)."""
    check_process_set(process_set)
    reduce_op = resolve_op(None, op)
    packed = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in packed]
    if torch.is_grad_enabled() and any(
        isinstance(c, torch.Tensor) and c.requires_grad for c in compressed
    ):
        results = list(
            _GroupedReducescatter.apply(
                reduce_op, name, prescale_factor, postscale_factor, *compressed
            )
        )
    else:
        results = _grouped_reducescatter(
            compressed, reduce_op, name, prescale_factor, postscale_factor
        ).wait()
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, packed, strict=True)]


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `grouped_reducescatter`; `synchronize(handle)` returns the blocks."""
    check_process_set(process_set)
    return _claimed(
        "grouped_reducescatter",
        name,
        lambda: _grouped_reducescatter(
            list(tensors), resolve_op(None, op), name, prescale_factor, postscale_factor
        ),
    )


# ---------------------------------------------------------------------------- the rest
def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank has called barrier."""
    check_process_set(process_set)
    core.barrier()


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces with neutral values
    until every rank has joined; returns the last rank to join. (An allgather, broadcast or
    alltoall while a rank has joined fails on every rank, as in Horovod.)"""
    return core.join()


def poll(handle: Any) -> bool:
    """Whether the async operation behind `handle` has finished."""
    return handle.done()


def synchronize(handle: Any) -> Any:
    """Wait for the async operation behind `handle`; returns its result."""
    return handle.wait()


class _HorovodSteps:
    """Horovod's step(): warns when it follows a manual synchronize() outside
    skip_synchronize() (Horovod would reduce again there; ringplug does not)."""

    def step(self, closure: Any = None) -> Any:
        if self._ringplug_synchronized and not self._ringplug_skip:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() after "
                "optimizer.synchronize(); the gradients are not reduced twice, but wrap the "
                "step in `with optimizer.skip_synchronize():` to say so.",
                stacklevel=2,
            )
        return super().step(closure)  # type: ignore[misc]


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = global_process_set,
) -> torch.optim.Optimizer:
    """Horovod's DistributedOptimizer: `ringplug.torch.DistributedOptimizer` underneath
    (gradients reduced in fused buckets while backward runs; `synchronize()` and
    `skip_synchronize()`). `num_groups`/`groups` are accepted and not needed: ringplug
    buckets by size. Sparse gradients are reduced as dense and handed back sparse."""
    check_process_set(process_set)
    reduce_op = resolve_op(None, op)
    if named_parameters is not None:
        named_parameters = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
            raise ValueError(
                "named_parameters should be a sequence of (name, parameter) "
                "tuples, such as model.named_parameters()."
            )
        names = [name for name, _ in named_parameters]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(
                f"named_parameters has duplicate names: {', '.join(duplicates)}. "
                "Give every parameter its own name."
            )
    fp16 = compression is Compression.fp16
    kind = _optimizer.Compression.fp16 if fp16 else _optimizer.Compression.none
    distributed = _optimizer.DistributedOptimizer(
        optimizer,
        named_parameters=named_parameters,
        backward_passes_per_step=backward_passes_per_step,
        compression=kind,
        op=reduce_op,
        gradient_predivide_factor=gradient_predivide_factor,
    )
    distributed.__class__ = type(
        distributed.__class__.__name__, (_HorovodSteps, distributed.__class__), {}
    )
    if named_parameters is not None:
        given = {id(p): name for name, p in named_parameters}
    else:
        params = [p for group in distributed.param_groups for p in group["params"]]
        given = {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
    # Horovod's attribute: parameter -> the name its gradient is reduced under.
    distributed._parameter_names = {
        p: given[id(p)]
        for group in distributed.param_groups
        for p in group["params"]
        if id(p) in given
    }
    return distributed


__all__ = [
    *_BASICS,
    "Compression",
    "DistributedOptimizer",
    "SyncBatchNorm",
    "elastic",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]
