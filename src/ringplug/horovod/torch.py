"""Horovod's ``horovod.torch`` API on ringplug: ``import ringplug.horovod.torch as hvd``.

Horovod 0.28's names and signatures over ``ringplug.torch``, which does the work. What
this module adds is where Horovod's semantics differ from ``ringplug.torch``'s:
`alltoall` returns only the tensor when no splits are given, and int32 counts;
allgather's and broadcast's gradients are the average of the ranks' gradients (ringplug's
are the sum) and reducescatter's ``size`` times ringplug's; allgather and broadcast fail
while a rank has joined; an async operation's name stays taken until its handle is
synchronized. Adasum (``op=hvd.Adasum``, on a power of two ranks) is in `torch_adasum`.
``process_set=`` runs an operation on a set's own engine (`on_process_set`), with root
ranks counted in the world, as Horovod.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import core
from ..compression import Compression, compressed
from ..core.kinds.base import at_once
from ..torch import averaging as _averaging
from ..torch import collectives as rt
from ..torch import optimizer as _optimizer
from ..torch import state as _state
from ..torch.sync_batchnorm import SyncBatchNorm
from . import torch_adasum, torch_elastic
from . import torch_elastic as elastic  # Horovod's hvd.elastic
from ._common import *  # noqa: F403 - Horovod's basics, re-exported
from ._common import (
    _SET,
    Adasum,
    Average,
    barrier,
    check_process_set,
    on_process_set,
    resolve_op,
)
from ._common import __all__ as _BASICS

_Tensors = Sequence[torch.Tensor]


class Handle:
    """Horovod's handle on an operation in flight, for `poll()` and `synchronize()`: a
    ``ringplug.torch.TensorHandle`` whose name stays taken until the program sees it end
    (not just until the engine ran it), so that a name submitted twice while one is in
    flight fails the same way on every rank, whatever the timing."""

    _taken: set[tuple[int, str, str]] = set()  # (engine, kind, name) not seen ending yet
    _lock = threading.Lock()

    def __init__(self, kind: str, name: str | None, start: Callable[[], Any]) -> None:
        self._claim = None if name is None else (id(core.runtime.engine()), kind, name)
        with Handle._lock:
            if self._claim in Handle._taken:
                raise ValueError(
                    f"hvd.{kind}: an operation named {name!r} is still in flight on rank "
                    f"{core.rank()}: synchronize its handle (or poll it until done) before "
                    "submitting the same name again, or give each tensor its own name."
                )
            if self._claim is not None:
                Handle._taken.add(self._claim)
        try:
            self._parts = start()
        except BaseException:
            self._release()
            raise

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
        if self._claim is not None:  # an unnamed operation holds no name: no lock to take
            with Handle._lock:
                Handle._taken.discard(self._claim)
            self._claim = None


# ---------------------------------------------------------------------------- Horovod's ways
def _reduction(
    average: Any, op: Any, process_set: Any, name: Any, prescale: float, postscale: float
) -> dict[str, Any]:
    """ringplug.torch's keyword arguments for Horovod's reduction arguments."""
    check_process_set(process_set)
    return {
        "op": resolve_op(average, op),
        "name": name,
        "prescale_factor": prescale,
        "postscale_factor": postscale,
    }


def _adasum_handle(
    kind: str,
    tensors: _Tensors,
    name: str | None,
    in_place: bool,
    process_set: Any,
    prescale: float,
    postscale: float,
    single: bool = False,
) -> Handle:
    """Horovod's handle on an Adasum reduction (`single`: its result is one tensor)."""
    _refuse_adasum_on_set()

    def begin() -> Any:
        handle = torch_adasum.adasum_async(list(tensors), name, in_place, prescale, postscale)
        return rt.TensorHandle(handle, (lambda results: results[0]) if single else list)

    return Handle(kind, name, begin)


def _refuse_adasum_on_set() -> None:
    """As Horovod: Adasum runs over all ranks only (`on_process_set` has entered a set's
    scope when process_set= named one)."""
    if core.runtime.scope.get() is not None:
        raise NotImplementedError(
            "Adasum does not support non-global process sets yet: leave process_set at "
            "hvd.global_process_set with op=hvd.Adasum, or use op=hvd.Average on the set."
        )


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


# ---------------------------------------------------------------------------- allreduce
@on_process_set
def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = _SET,
) -> torch.Tensor:
    """The reduction of `tensor` over every rank, as a new tensor (differentiable)."""
    if op is Adasum:
        _refuse_adasum_on_set()
        return compressed(
            compression,
            [tensor],
            lambda sent: torch_adasum.adasum(sent, name, prescale_factor, postscale_factor),
        )[0]
    kwargs = _reduction(average, op, process_set, name, prescale_factor, postscale_factor)
    return compressed(compression, [tensor], lambda sent: [rt.allreduce(*sent, **kwargs)])[0]


@on_process_set
def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = _SET,
) -> Handle:
    """Start `allreduce`; `synchronize(handle)` returns the result (the input is not changed)."""
    if op is Adasum:
        return _adasum_handle(
            "allreduce", [tensor], name, False, process_set, prescale_factor, postscale_factor, True
        )
    kwargs = _reduction(average, op, process_set, name, prescale_factor, postscale_factor)
    return Handle("allreduce", name, lambda: rt.allreduce_async(tensor, **kwargs))


@on_process_set
def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = _SET,
) -> torch.Tensor:
    """`allreduce` in place; returns `tensor`."""
    return at_once(
        lambda: allreduce_async_(
            tensor, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


@on_process_set
def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = _SET,
) -> Handle:
    """Start `allreduce_` (in place); `synchronize(handle)` returns `tensor`."""
    if op is Adasum:
        return _adasum_handle(
            "allreduce", [tensor], name, True, process_set, prescale_factor, postscale_factor, True
        )
    kwargs = _reduction(average, op, process_set, name, prescale_factor, postscale_factor)
    return Handle("allreduce", name, lambda: rt.allreduce_async_(tensor, **kwargs))


@on_process_set
def grouped_allreduce(
    tensors: _Tensors,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = _SET,
) -> list[torch.Tensor]:
    """Several tensors reduced as one request; returns new tensors (differentiable)."""
    if op is Adasum:
        _refuse_adasum_on_set()
        return compressed(
            compression,
            tensors,
            lambda sent: torch_adasum.adasum(sent, name, prescale_factor, postscale_factor),
        )
    kwargs = _reduction(average, op, process_set, name, prescale_factor, postscale_factor)
    return compressed(compression, tensors, lambda sent: rt.grouped_allreduce(sent, **kwargs))


@on_process_set
def grouped_allreduce_async(
    tensors: _Tensors,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = _SET,
) -> Handle:
    """Start `grouped_allreduce`; `synchronize(handle)` returns the new tensors."""
    if op is Adasum:
        return _adasum_handle(
            "grouped_allreduce",
            tensors,
            name,
            False,
            process_set,
            prescale_factor,
            postscale_factor,
        )
    kwargs = _reduction(average, op, process_set, name, prescale_factor, postscale_factor)
    return Handle("grouped_allreduce", name, lambda: rt.grouped_allreduce_async(tensors, **kwargs))


@on_process_set
def grouped_allreduce_(
    tensors: _Tensors,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = _SET,
) -> list[torch.Tensor]:
    """`grouped_allreduce` in place; returns `tensors`."""
    return at_once(
        lambda: grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


@on_process_set
def grouped_allreduce_async_(
    tensors: _Tensors,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = _SET,
) -> Handle:
    """Start `grouped_allreduce_` (in place); `synchronize(handle)` returns `tensors`."""
    if op is Adasum:
        return _adasum_handle(
            "grouped_allreduce", tensors, name, True, process_set, prescale_factor, postscale_factor
        )
    kwargs = _reduction(average, op, process_set, name, prescale_factor, postscale_factor)
    return Handle("grouped_allreduce", name, lambda: rt.grouped_allreduce_async_(tensors, **kwargs))


@on_process_set
def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any, process_set: Any = _SET
) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor (`ringplug.torch.allreduce_async` gathers every rank's
    indices and values); returns a function that waits and gives the result (Horovod's
    form)."""
    check_process_set(process_set)
    return rt.allreduce_async(tensor, resolve_op(None, op), name=name).wait


# ---------------------------------------------------------------------------- allgather
@on_process_set
def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = _SET
) -> torch.Tensor:
    """Every rank's `tensor` concatenated on the first dimension (which may differ);
    differentiable (each rank's rows get the average of the ranks' gradients for them)."""
    check_process_set(process_set)
    (graded,) = _graded([tensor], over=core.size())
    return rt.allgather(graded, name=name, refuse_joined=True)


@on_process_set
def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = _SET
) -> Handle:
    """Start `allgather`; `synchronize(handle)` returns the gathered tensor."""
    check_process_set(process_set)
    return Handle(
        "allgather", name, lambda: rt.allgather_async(tensor, name=name, refuse_joined=True)
    )


@on_process_set
def grouped_allgather(
    tensors: _Tensors, name: str | None = None, process_set: Any = _SET
) -> list[torch.Tensor]:
    """`allgather` of several tensors started together; returns the gathered tensors
    (differentiable)."""
    check_process_set(process_set)
    graded = _graded(list(tensors), over=core.size())
    return rt.grouped_allgather(graded, name=name, refuse_joined=True)


@on_process_set
def grouped_allgather_async(
    tensors: _Tensors, name: str | None = None, process_set: Any = _SET
) -> Handle:
    """Start `grouped_allgather`; `synchronize(handle)` returns the list."""
    check_process_set(process_set)
    return Handle(
        "grouped_allgather",
        name,
        lambda: rt.grouped_allgather_async(list(tensors), name=name, refuse_joined=True),
    )


# ---------------------------------------------------------------------------- broadcast
@on_process_set
def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = _SET
) -> torch.Tensor:
    """Root's `tensor` on every rank, as a new tensor (differentiable: root's gets the
    average of the ranks' gradients, the others' zero)."""
    check_process_set(process_set)
    (graded,) = _graded([tensor], over=core.size())
    return rt.broadcast(graded, root_rank, name=name, refuse_joined=True)


@on_process_set
def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = _SET
) -> torch.Tensor:
    """Overwrite `tensor` with root's on every rank; returns `tensor`."""
    return at_once(lambda: broadcast_async_(tensor, root_rank, name, process_set))


@on_process_set
def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = _SET
) -> Handle:
    """Start `broadcast`; `synchronize(handle)` returns root's tensor (a new one)."""
    check_process_set(process_set)
    return Handle(
        "broadcast",
        name,
        lambda: rt.broadcast_async(tensor, root_rank, name=name, refuse_joined=True),
    )


@on_process_set
def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = _SET
) -> Handle:
    """Start `broadcast_` (in place); `synchronize(handle)` returns `tensor`."""
    check_process_set(process_set)
    return Handle(
        "broadcast",
        name,
        lambda: rt.broadcast_async_(tensor, root_rank, name=name, refuse_joined=True),
    )


# ---------------------------------------------------------------------------- alltoall
def _int32_counts(result: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    return result[0], result[1].to(torch.int32)


@on_process_set
def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = _SET,
) -> Any:
    """Rows ``splits[i]`` of `tensor` to rank i (an even split without `splits`); the rows
    received, in rank order, and with `splits` also the int32 counts received (as Horovod).
    Differentiable."""
    check_process_set(process_set)
    received, counts = _int32_counts(rt.alltoall(tensor, splits, name=name))
    return received if splits is None else (received, counts)


@on_process_set
def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = _SET,
) -> Handle:
    """Start `alltoall`; `synchronize(handle)` returns (received rows, received counts)."""
    check_process_set(process_set)
    return Handle(
        "alltoall",
        name,
        lambda: rt.TensorHandle(rt.alltoall_async(tensor, splits, name=name), _int32_counts),
    )


# ---------------------------------------------------------------------------- reducescatter
@on_process_set
def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = _SET,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's block of rows of the reduction (earlier ranks get a row more when the
    rows do not divide); differentiable."""
    kwargs = _reduction(None, op, process_set, name, prescale_factor, postscale_factor)

    def reduce(sent: list) -> list:  # Horovod's gradient: `size` times ringplug.torch's
        return [rt.reducescatter(*_graded(sent, times=core.size()), **kwargs)]

    return compressed(compression, [tensor], reduce)[0]


@on_process_set
def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: Any = _SET,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `reducescatter`; `synchronize(handle)` returns this rank's block."""
    kwargs = _reduction(None, op, process_set, name, prescale_factor, postscale_factor)
    return Handle("reducescatter", name, lambda: rt.reducescatter_async(tensor, **kwargs))


@on_process_set
def grouped_reducescatter(
    tensors: _Tensors,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = _SET,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """`reducescatter` of several tensors started together; returns this rank's blocks
    (differentiable)."""
    kwargs = _reduction(None, op, process_set, name, prescale_factor, postscale_factor)

    def reduce(sent: list) -> list:  # Horovod's gradient: `size` times ringplug.torch's
        return rt.grouped_reducescatter(_graded(sent, times=core.size()), **kwargs)

    return compressed(compression, tensors, reduce)


@on_process_set
def grouped_reducescatter_async(
    tensors: _Tensors,
    name: str | None = None,
    op: Any = Average,
    process_set: Any = _SET,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start `grouped_reducescatter`; `synchronize(handle)` returns the blocks."""
    kwargs = _reduction(None, op, process_set, name, prescale_factor, postscale_factor)
    return Handle(
        "grouped_reducescatter", name, lambda: rt.grouped_reducescatter_async(tensors, **kwargs)
    )


# ---------------------------------------------------------------------------- the rest
@on_process_set
def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = _SET
) -> Any:
    """Root's picklable `obj` (tensors included) on every rank."""
    check_process_set(process_set)
    return _state.broadcast_object(obj, root_rank, name=name)


@on_process_set
def allgather_object(obj: Any, name: str | None = None, process_set: Any = _SET) -> list[Any]:
    """Every rank's picklable `obj`, as a list in rank order."""
    check_process_set(process_set)
    return _state.allgather_object(obj, name=name)


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
    process_set: Any = _SET,
) -> torch.optim.Optimizer:
    """Horovod's DistributedOptimizer: `ringplug.torch.DistributedOptimizer` underneath
    (gradients reduced in fused buckets while backward runs; `synchronize()` and
    `skip_synchronize()`). `num_groups`/`groups` are accepted and not needed: ringplug
    buckets by size. Sparse gradients are reduced as dense and handed back sparse.

    With `process_set`, gradients are reduced among the set's ranks only (averaged over
    its size); on a rank outside the set, the optimizer steps on its own gradients, as in
    Horovod."""
    named = None if named_parameters is None else list(named_parameters)
    if process_set is not _SET and process_set is not None:
        if op is Adasum:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        if not process_set.included():
            return _local_optimizer(optimizer, named)
        scoped = on_process_set(_distributed)  # built, and later reducing, on the set
        return scoped(
            optimizer,
            named,
            compression,
            backward_passes_per_step,
            op,
            gradient_predivide_factor,
            process_set,
        )
    if op is Adasum:
        return torch_adasum.DistributedOptimizer(optimizer, named, backward_passes_per_step)
    return _distributed(
        optimizer, named, compression, backward_passes_per_step, op, gradient_predivide_factor
    )


def _distributed(
    optimizer: torch.optim.Optimizer,
    named: Any,
    compression: Any,
    backward_passes_per_step: int,
    op: Any,
    gradient_predivide_factor: float,
    process_set: Any = _SET,
) -> torch.optim.Optimizer:
    """ringplug.torch's DistributedOptimizer with Horovod's steps, on the current engine
    (a process set's inside its scope: the optimizer keeps reducing on it)."""
    distributed = _optimizer.DistributedOptimizer(
        optimizer,
        named_parameters=named,
        backward_passes_per_step=backward_passes_per_step,
        compression=compression if isinstance(compression, Compression) else Compression.none,
        op=resolve_op(None, op),
        gradient_predivide_factor=gradient_predivide_factor,
    )
    # A subclass of ringplug's own optimizer class (no framework internal is touched):
    # Horovod's step warnings on top of ringplug.torch's.
    cls = distributed.__class__
    distributed.__class__ = type(cls.__name__, (_HorovodSteps, cls), {})
    # Horovod's attribute: parameter -> the name its gradient is reduced under.
    names = distributed._ringplug_names
    params = [p for group in distributed.param_groups for p in group["params"]]
    distributed._parameter_names = {p: names[id(p)] for p in params if id(p) in names}
    return distributed


class _LocalSteps:
    """Horovod's DistributedOptimizer on a rank outside its process set: steps on the
    rank's own gradients; `synchronize()` has nothing to reduce."""

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def skip_synchronize(self) -> Any:
        yield


def _local_optimizer(optimizer: torch.optim.Optimizer, named: Any) -> torch.optim.Optimizer:
    # Takes its number among the optimizers as the members' does, so that the optimizers
    # every rank builds next name their gradients alike.
    next(_averaging._OPTIMIZER_IDS)
    cls = optimizer.__class__
    local = cls.__new__(type(cls.__name__, (_LocalSteps, cls), {}))
    local.__dict__.update(optimizer.__dict__)  # same param_groups, state and hooks
    names = {id(p): n for n, p in named} if named is not None else {}
    params = [p for group in local.param_groups for p in group["params"]]
    local._parameter_names = {p: names.get(id(p), f"param.{i}") for i, p in enumerate(params)}
    return local


@on_process_set
def broadcast_parameters(params: Any, root_rank: int, process_set: Any = _SET) -> None:
    """Overwrite every rank's parameters (a ``state_dict()`` or ``named_parameters()``)
    with root's, in place; with `process_set`, among its members (root: a world rank)."""
    _state.broadcast_parameters(params, root_rank)


@on_process_set
def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: torch.nn.Module | None = None,
    process_set: Any = _SET,
) -> None:
    """Root's optimizer state and hyperparameters on every rank (`torch_elastic`'s, which
    says what it does on an optimizer that has not stepped); with `process_set`, among its
    members (root: a world rank)."""
    torch_elastic.broadcast_optimizer_state(optimizer, root_rank, model)


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
