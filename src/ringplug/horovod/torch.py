"""Horovod's ``horovod.torch`` API on ringplug: ``import ringplug.horovod.torch as hvd``.

Same names, signatures and semantics as Horovod 0.28's PyTorch API for what ringplug
supports: the collectives (sync, async, in place, grouped), their autograd, the
broadcast helpers, `DistributedOptimizer`, `Compression` and `SyncBatchNorm`. What it does
not support raises with the reason: Adasum, process sets other than the global one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import core
from ..core.ops import ReduceOp
from ..torch import collectives as rt
from ..torch import optimizer as _optimizer
from ..torch.state import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ..torch.sync_batchnorm import SyncBatchNorm
from ._common import *  # noqa: F403 - Horovod's basics, re-exported
from ._common import Average, check_process_set, global_process_set, resolve_op
from ._common import __all__ as _BASICS


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


# ---------------------------------------------------------------------------- allreduce
def _allreduce_args(average: bool | None, op: Any, process_set: Any) -> ReduceOp:
    check_process_set(process_set)
    return resolve_op(average, op)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, name: str | None, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return rt.allreduce(tensor, op, name=name, prescale_factor=pre, postscale_factor=post)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = rt.allreduce(
            grad.contiguous(), ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post
        )
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
    reduce_op = _allreduce_args(average, op, process_set)
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        result = _Allreduce.apply(compressed, reduce_op, name, prescale_factor, postscale_factor)
    else:
        result = rt.allreduce(
            compressed,
            reduce_op,
            name=name,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
    return compression.decompress(result, ctx)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> rt.TensorHandle:
    """Start `allreduce`; `synchronize(handle)` returns the result."""
    return rt.allreduce_async(
        tensor,
        _allreduce_args(average, op, process_set),
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
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
    return rt.allreduce_(
        tensor,
        _allreduce_args(average, op, process_set),
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> rt.TensorHandle:
    return rt.allreduce_async_(
        tensor,
        _allreduce_args(average, op, process_set),
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


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
    """Several tensors reduced as one request; returns new tensors."""
    packed = [compression.compress(t) for t in tensors]
    results = rt.grouped_allreduce(
        [c for c, _ in packed],
        _allreduce_args(average, op, process_set),
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, packed, strict=True)]


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> rt.TensorHandle:
    copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return rt.grouped_allreduce_async_(
        copies,
        _allreduce_args(average, op, process_set),
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
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
) -> rt.TensorHandle:
    return rt.grouped_allreduce_async_(
        tensors,
        _allreduce_args(average, op, process_set),
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


# ---------------------------------------------------------------------------- the others
def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """Every rank's `tensor` concatenated on the first dimension (which may differ);
    differentiable (each rank's rows get the sum of the ranks' gradients for them)."""
    check_process_set(process_set)
    return rt.allgather(tensor, name=name)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> rt.TensorHandle:
    check_process_set(process_set)
    return rt.allgather_async(tensor, name=name)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ctx.root_rank = root_rank
        return rt.broadcast(tensor, root_rank, name=name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # As Horovod: the averaged gradient on the root, zero elsewhere.
        reduced = rt.allreduce(grad.contiguous(), "average")
        if core.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Root's `tensor` on every rank, as a new tensor (differentiable, as Horovod)."""
    check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, name)
    return rt.broadcast(tensor, root_rank, name=name)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    check_process_set(process_set)
    return rt.broadcast_(tensor, root_rank, name=name)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> rt.TensorHandle:
    check_process_set(process_set)
    return rt.broadcast_async_(tensor.detach().clone(), root_rank, name=name)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> rt.TensorHandle:
    check_process_set(process_set)
    return rt.broadcast_async_(tensor, root_rank, name=name)


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``splits[i]`` of `tensor` to rank i; returns (received rows, received splits)."""
    check_process_set(process_set)
    return rt.alltoall(tensor, splits, name=name)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """This rank's block of rows of the reduction (earlier ranks get a row more when the
    rows do not divide)."""
    check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(
        rt.reducescatter(compressed, resolve_op(None, op), name=name), ctx
    )


def barrier(process_set: Any = global_process_set) -> None:
    check_process_set(process_set)
    core.barrier()


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' collectives with neutral values
    until every rank has joined; returns the last rank to join."""
    return core.join()


def poll(handle: rt.TensorHandle) -> bool:
    """Whether the async operation behind `handle` has finished."""
    return handle.done()


def synchronize(handle: rt.TensorHandle) -> Any:
    """Wait for the async operation behind `handle`; returns its result."""
    return handle.wait()


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
    buckets by size. Sparse gradients are always reduced as dense."""
    check_process_set(process_set)
    fp16 = compression is Compression.fp16
    kind = _optimizer.Compression.fp16 if fp16 else _optimizer.Compression.none
    return _optimizer.DistributedOptimizer(
        optimizer,
        named_parameters=named_parameters,
        backward_passes_per_step=backward_passes_per_step,
        compression=kind,
        op=resolve_op(None, op),
        gradient_predivide_factor=gradient_predivide_factor,
    )


__all__ = [
    *_BASICS, "Compression", "DistributedOptimizer", "SyncBatchNorm", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "join", "poll", "reducescatter",
    "synchronize",
]  # fmt: skip
