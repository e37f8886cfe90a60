"""Horovod's ``horovod.torch`` API on ringplug: ``import ringplug.horovod.torch as hvd``.

Horovod 0.28's names and signatures over ``ringplug.torch``, which does the work: its
collectives (differentiable), `TensorHandle`, `DistributedOptimizer`, `Compression`,
`SyncBatchNorm` and broadcast helpers. ``hvd.elastic`` is `ringplug.horovod.torch_elastic`.
What ringplug does not support raises with the reason: Adasum, process sets other than
the global one.

What this module adds is where Horovod's semantics differ from ``ringplug.torch``'s:
`Average` and scale factors work on integer tensors (scaled in float64, truncated toward
zero); `alltoall` returns only the tensor when no splits are given, and int32 counts;
allgather's and broadcast's gradients are the average of the ranks' gradients (ringplug's
are the sum) and reducescatter's ``size`` times ringplug's; allgather and broadcast fail
while a rank has joined; an async operation's name stays taken until its handle is
synchronized.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import core
from ..compression import Compression
from ..core.ops import ReduceOp
from ..torch import collectives as rt
from ..torch import optimizer as _optimizer
from ..torch import state as _state
from ..torch.state import broadcast_parameters
from ..torch.sync_batchnorm import SyncBatchNorm
from . import torch_elastic as elastic  # Horovod's hvd.elastic
from ._common import *  # noqa: F403 - Horovod's basics, re-exported
from ._common import Average, check_process_set, global_process_set, resolve_op
from ._common import __all__ as _BASICS
from ._torch_state import broadcast_optimizer_state

_Tensors = Sequence[torch.Tensor]

# The names of the asynchronous operations whose handles the program has not synchronized
# (nor seen done with `poll`), per engine and kind: ``(id(engine), "allreduce", name)``.
# As in Horovod, two operations of one kind and name may not be in flight together; here
# "in flight" lasts until the program has seen the first one end, not until the engine ran
# it, so that submitting a name twice fails the same way on every rank whatever the timing.
_unsynchronized: set[tuple[int, str, str]] = set()
_unsynchronized_lock = threading.Lock()


class Handle:
    """Horovod's handle on an operation in flight, for `poll()` and `synchronize()`: a
    ``ringplug.torch.TensorHandle`` whose name stays taken until the program sees it end."""

    def __init__(self, parts: rt.TensorHandle, claim: tuple[int, str, str] | None) -> None:
        self._parts, self._claim = parts, claim

    def done(self) -> bool:
        if self._parts.done():
            self._release()
            return True
        return False

    def wait(self) -> Any:
        try:
            return self._parts.wait()
        finally:
            self._release()

    def _release(self) -> None:
        if self._claim is not None:
            with _unsynchronized_lock:
                _unsynchronized.discard(self._claim)
            self._claim = None


def _claimed(kind: str, name: str | None, start: Callable[[], rt.TensorHandle]) -> Handle:
    """`start()` the asynchronous `kind` operation named `name`, refusing the name while an
    earlier one of that kind has not been synchronized."""
    if name is None:
        return Handle(start(), None)
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
        return Handle(start(), key)
    except BaseException:
        with _unsynchronized_lock:
            _unsynchronized.discard(key)
        raise


# ---------------------------------------------------------------------------- Horovod's ways
def _integer_scale(tensors: list[Any], op: ReduceOp, pre: float, post: float) -> float | None:
    """What to scale the sum by afterwards when Horovod scales integer `tensors` itself
    (Average, or Sum with scale factors), else None: ringplug refuses them. Horovod scales
    in float64 and truncates toward zero, each rank's values by `pre` before the sum."""
    first = tensors[0] if tensors else None
    if not isinstance(first, torch.Tensor) or first.is_floating_point() or first.is_complex():
        return None
    if first.dtype is torch.bool or op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return None
    if op is ReduceOp.SUM and pre == post == 1.0:
        return None
    return post / core.size() if op is ReduceOp.AVERAGE else post


def _truncated(tensor: torch.Tensor, factor: float, out: torch.Tensor | None = None) -> Any:
    """`tensor` times `factor`, in float64 and truncated toward zero, into `out` (default:
    a new tensor)."""
    scaled = (tensor.detach().to(torch.float64) * factor).to(tensor.dtype)
    if out is None:
        return scaled
    with torch.no_grad():
        return out.copy_(scaled)


def _copy(tensor: Any) -> Any:
    if not isinstance(tensor, torch.Tensor):
        return tensor  # refused by ringplug.torch, on every rank
    return tensor.detach().clone(memory_format=torch.contiguous_format)


# ringplug.torch's forms of Horovod's reductions: async on one tensor, async grouped (an
# allreduce's in place, a reducescatter's into new blocks), then the differentiable ones.
_FORMS = {
    "allreduce": (
        rt.allreduce_async_,
        rt.grouped_allreduce_async_,
        rt.allreduce,
        rt.grouped_allreduce,
    ),
    "reducescatter": (
        rt.reducescatter_async,
        rt.grouped_reducescatter_async,
        rt.reducescatter,
        rt.grouped_reducescatter,
    ),
}


def _reduce_async(
    kind: str,
    tensors: Any,
    op: ReduceOp,
    name: Any,
    scales: tuple,
    grouped: bool,
    in_place: bool = False,
) -> rt.TensorHandle:
    """Start Horovod's (grouped) `kind`, with Horovod's integer scaling around it; an
    allreduce works on `tensors` when `in_place`, else on copies."""
    one, group = _FORMS[kind][:2]

    def start(works: list, op: ReduceOp, pre: float, post: float) -> rt.TensorHandle:
        kwargs = {"name": name, "prescale_factor": pre, "postscale_factor": post}
        return group(works, op, **kwargs) if grouped else one(works[0], op, **kwargs)

    tensors = list(tensors)
    after = _integer_scale(tensors, op, *scales)
    if after is None:
        copy = kind == "allreduce" and not in_place  # a reducescatter leaves its input alone
        return start([_copy(t) for t in tensors] if copy else tensors, op, *scales)
    works = [_truncated(t, scales[0], t if in_place else None) for t in tensors]

    def finish(result: Any) -> Any:
        for tensor in _listed(result):
            _truncated(tensor, after, tensor)
        return result

    return rt.TensorHandle(start(works, ReduceOp.SUM, 1.0, 1.0), finish)


def _reduced(
    kind: str,
    tensors: Any,
    op: ReduceOp,
    name: Any,
    compression: Any,
    scales: tuple,
    grouped: bool,
) -> list[torch.Tensor]:
    """Horovod's (grouped) `kind` into new tensors, differentiable (a reducescatter's
    gradient is ``size`` times ringplug.torch's)."""
    one, group = _FORMS[kind][2:]

    def reduce(sent: list) -> list:
        if _integer_scale(sent, op, *scales) is not None:  # integers: never on the graph
            return _listed(_reduce_async(kind, sent, op, name, scales, grouped).wait())
        if kind == "reducescatter":
            sent = _graded(sent, times=core.size())
        kwargs = {"name": name, "prescale_factor": scales[0], "postscale_factor": scales[1]}
        return group(sent, op, **kwargs) if grouped else [one(sent[0], op, **kwargs)]

    return _compressed(compression, tensors, reduce)


def _listed(result: Any) -> list:
    return result if isinstance(result, list) else [result]


class _ScaledGradient(torch.autograd.Function):
    """The identity, whose gradient is multiplied by `times` and divided by `over`: where
    Horovod's gradient of a collective is a multiple of ringplug.torch's."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, times: int, over: int) -> torch.Tensor:
        ctx.times, ctx.over = times, over
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        return grad * ctx.times / ctx.over, None, None


def _graded(tensors: list, times: int = 1, over: int = 1) -> list:
    """`tensors`, with Horovod's gradient scaling where autograd tracks them."""
    if not torch.is_grad_enabled():
        return tensors
    return [
        _ScaledGradient.apply(t, times, over)
        if isinstance(t, torch.Tensor) and t.requires_grad
        else t
        for t in tensors
    ]


def _op(average: bool | None, op: Any, process_set: Any) -> ReduceOp:
    check_process_set(process_set)
    return resolve_op(average, op)


def _compressed(compression: Any, tensors: Any, reduce: Callable[[list], list]) -> list:
    """``reduce`` of the compressed `tensors`, decompressed."""
    packed = [compression.compress(t) for t in tensors]
    results = reduce([sent for sent, _ in packed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, packed, strict=True)]


# ---------------------------------------------------------------------------- allreduce
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
    """The reduction of `tensor` over every rank, as a new tensor (differentiable)."""
    scales = (prescale_factor, postscale_factor)
    reduce_op = _op(average, op, process_set)
    return _reduced("allreduce", [tensor], reduce_op, name, compression, scales, False)[0]


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
    scales, reduce_op = (prescale_factor, postscale_factor), _op(average, op, process_set)
    return _claimed(
        "allreduce",
        name,
        lambda: _reduce_async("allreduce", [tensor], reduce_op, name, scales, False, False),
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
    scales, reduce_op = (prescale_factor, postscale_factor), _op(average, op, process_set)
    return _claimed(
        "allreduce",
        name,
        lambda: _reduce_async("allreduce", [tensor], reduce_op, name, scales, False, True),
    )


def grouped_allreduce(
    tensors: _Tensors,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """Several tensors reduced as one request; returns new tensors (differentiable)."""
    scales = (prescale_factor, postscale_factor)
    reduce_op = _op(average, op, process_set)
    return _reduced("allreduce", tensors, reduce_op, name, compression, scales, True)


def grouped_allreduce_async(
    tensors: _Tensors,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `grouped_allreduce`; `synchronize(handle)` returns the new tensors."""
    scales, reduce_op = (prescale_factor, postscale_factor), _op(average, op, process_set)
    return _claimed(
        "grouped_allreduce",
        name,
        lambda: _reduce_async("allreduce", tensors, reduce_op, name, scales, True, False),
    )


def grouped_allreduce_(
    tensors: _Tensors,
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
    tensors: _Tensors,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `grouped_allreduce_` (in place); `synchronize(handle)` returns `tensors`."""
    scales, reduce_op = (prescale_factor, postscale_factor), _op(average, op, process_set)
    return _claimed(
        "grouped_allreduce",
        name,
        lambda: _reduce_async("allreduce", tensors, reduce_op, name, scales, True, True),
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
    gathered = rt.TensorHandle(
        [
            rt.allgather_async(sparse.indices().t().contiguous(), name=f"{name}.indices"),
            rt.allgather_async(sparse.values().contiguous(), name=f"{name}.values"),
        ],
        list,
    )

    def wait() -> torch.Tensor:
        indices, values = gathered.wait()
        if reduce_op is ReduceOp.AVERAGE:
            values = values / core.size()
        return torch.sparse_coo_tensor(indices.t(), values, tensor.size(), check_invariants=True)

    return wait


# ---------------------------------------------------------------------------- allgather
def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """Every rank's `tensor` concatenated on the first dimension (which may differ);
    differentiable (each rank's rows get the average of the ranks' gradients for them)."""
    check_process_set(process_set)
    (graded,) = _graded([tensor], over=core.size())
    return rt.allgather(graded, name=name, refuse_joined=True)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Start `allgather`; `synchronize(handle)` returns the gathered tensor."""
    check_process_set(process_set)
    return _claimed(
        "allgather", name, lambda: rt.allgather_async(tensor, name=name, refuse_joined=True)
    )


def grouped_allgather(
    tensors: _Tensors,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """`allgather` of several tensors started together; returns the gathered tensors
    (differentiable)."""
    check_process_set(process_set)
    graded = _graded(list(tensors), over=core.size())
    return rt.grouped_allgather(graded, name=name, refuse_joined=True)


def grouped_allgather_async(
    tensors: _Tensors,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `grouped_allgather`; `synchronize(handle)` returns the list."""
    check_process_set(process_set)
    return _claimed(
        "grouped_allgather",
        name,
        lambda: rt.grouped_allgather_async(list(tensors), name=name, refuse_joined=True),
    )


# ---------------------------------------------------------------------------- broadcast
def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Root's `tensor` on every rank, as a new tensor (differentiable: root's gets the
    average of the ranks' gradients, the others' zero)."""
    check_process_set(process_set)
    (graded,) = _graded([tensor], over=core.size())
    return rt.broadcast(graded, root_rank, name=name, refuse_joined=True)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Overwrite `tensor` with root's on every rank; returns `tensor`."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `broadcast`; `synchronize(handle)` returns root's tensor (a new one)."""
    check_process_set(process_set)
    return _claimed(
        "broadcast",
        name,
        lambda: rt.broadcast_async(tensor, root_rank, name=name, refuse_joined=True),
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
        lambda: rt.broadcast_async_(tensor, root_rank, name=name, refuse_joined=True),
    )


# ---------------------------------------------------------------------------- alltoall
def _int32_counts(result: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    return result[0], result[1].to(torch.int32)


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
    received, counts = _int32_counts(rt.alltoall(tensor, splits, name=name))
    return received if splits is None else (received, counts)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start `alltoall`; `synchronize(handle)` returns (received rows, received counts)."""
    check_process_set(process_set)
    return _claimed(
        "alltoall",
        name,
        lambda: rt.TensorHandle(rt.alltoall_async(tensor, splits, name=name), _int32_counts),
    )


# ---------------------------------------------------------------------------- reducescatter
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
    scales, reduce_op = (prescale_factor, postscale_factor), _op(None, op, process_set)
    return _reduced("reducescatter", [tensor], reduce_op, name, compression, scales, False)[0]


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `reducescatter`; `synchronize(handle)` returns this rank's block."""
    scales, reduce_op = (prescale_factor, postscale_factor), _op(None, op, process_set)
    return _claimed(
        "reducescatter",
        name,
        lambda: _reduce_async("reducescatter", [tensor], reduce_op, name, scales, False),
    )


def grouped_reducescatter(
    tensors: _Tensors,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """`reducescatter` of several tensors started together; returns this rank's blocks
    (differentiable)."""
    scales, reduce_op = (prescale_factor, postscale_factor), _op(None, op, process_set)
    return _reduced("reducescatter", tensors, reduce_op, name, compression, scales, True)


def grouped_reducescatter_async(
    tensors: _Tensors,
    name: str | None = None,
    op: Any = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `grouped_reducescatter`; `synchronize(handle)` returns the blocks."""
    scales, reduce_op = (prescale_factor, postscale_factor), _op(None, op, process_set)
    return _claimed(
        "grouped_reducescatter",
        name,
        lambda: _reduce_async("reducescatter", tensors, reduce_op, name, scales, True),
    )


# ---------------------------------------------------------------------------- the rest
def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Root's picklable `obj` (tensors included) on every rank."""
    check_process_set(process_set)
    return _state.broadcast_object(obj, root_rank, name=name)


def allgather_object(
    obj: Any, name: str | None = None, process_set: Any = global_process_set
) -> list[Any]:
    """Every rank's picklable `obj`, as a list in rank order."""
    check_process_set(process_set)
    return _state.allgather_object(obj, name=name)


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank has called barrier."""
    check_process_set(process_set)
    core.barrier()


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces with neutral values
    until every rank has joined; returns the last rank to join. (An allgather, broadcast or
    alltoall while a rank has joined fails on every rank, as in Horovod.)"""
    return core.join()


def poll(handle: Handle) -> bool:
    """Whether the async operation behind `handle` has finished."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
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
    named = None if named_parameters is None else list(named_parameters)
    distributed = _optimizer.DistributedOptimizer(
        optimizer,
        named_parameters=named,
        backward_passes_per_step=backward_passes_per_step,
        compression=compression if isinstance(compression, Compression) else Compression.none,
        op=resolve_op(None, op),
        gradient_predivide_factor=gradient_predivide_factor,
    )
    cls = distributed.__class__
    distributed.__class__ = type(cls.__name__, (_HorovodSteps, cls), {})
    params = [p for group in distributed.param_groups for p in group["params"]]
    given = {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
    given = given if named is None else {id(p): name for name, p in named}
    # Horovod's attribute: parameter -> the name its gradient is reduced under.
    distributed._parameter_names = {p: given[id(p)] for p in params if id(p) in given}
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
