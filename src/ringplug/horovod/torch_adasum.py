"""Horovod's Adasum for torch: ``hvd.allreduce(..., op=hvd.Adasum)`` and its async and
grouped forms, and ``hvd.DistributedOptimizer(..., op=hvd.Adasum)``, on the core's Adasum
kind (`ringplug.core.kinds.adasum`).

As in Horovod's CPU build, a result is the Adasum itself (no division by the number of
ranks), tensors on a GPU are reduced through a copy on the CPU, and the number of ranks
must be a power of two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..core import collectives as core_collectives
from ..core.kinds.adasum import check_size
from ..torch.collectives import TensorHandle, as_numpy


def adasum_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    in_place: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start the Adasum of each of `tensors` over every rank (each with its own dot products
    and norms); `wait()` returns the list of results (`tensors` themselves when
    `in_place`). Raises NotImplementedError on every rank when the number of ranks is not a
    power of two; a dtype other than float16, float32 or float64 fails the handle with
    TypeError here and PeerArgumentError on the other ranks."""
    check_size()
    works, handles = [], []
    for index, tensor in enumerate(tensors):
        # The core reads and writes host memory: a CPU copy unless the tensor can be used
        # as it is (in place, contiguous, on the CPU).
        direct = in_place and tensor.device.type == "cpu" and tensor.is_contiguous()
        work = tensor.detach() if direct else tensor.detach().to("cpu", copy=True).contiguous()
        if prescale_factor != 1.0:
            work.mul_(prescale_factor)
        # bfloat16 and integers reach the core, which refuses them on every rank at once.
        array, dtype = as_numpy(work)
        member = name if name is None or len(tensors) == 1 else f"{name}.{index}"
        works.append(work)
        handles.append(core_collectives.adasum_async(array, out=array, name=member, dtype=dtype))

    def finish(_: Any) -> list[torch.Tensor]:
        results = []
        for tensor, work in zip(tensors, works, strict=True):
            if postscale_factor != 1.0:
                work.mul_(postscale_factor)
            if in_place:
                if work.data_ptr() != tensor.data_ptr():
                    tensor.data.copy_(work)
                results.append(tensor)
            else:
                results.append(work.to(tensor.device) if tensor.device.type != "cpu" else work)
        return results

    return TensorHandle(handles, finish)


class _Adasum(torch.autograd.Function):
    """Adasum that autograd sees through: the gradient is the Adasum of the gradients, as
    Horovod's allreduce reduces gradients with the op of its forward pass."""

    @staticmethod
    def forward(ctx: Any, name: Any, *tensors: torch.Tensor) -> Any:
        ctx.name = name
        return tuple(adasum_async(tensors, name).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        name = None if ctx.name is None else f"{ctx.name}.grad"
        return (None, *adasum_async([g.contiguous() for g in grads], name).wait())


def adasum(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """The Adasum of each of `tensors`, as new tensors (differentiable)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        scaled = [t * prescale_factor for t in tensors] if prescale_factor != 1.0 else tensors
        results = list(_Adasum.apply(name, *scaled))
        return [r * postscale_factor for r in results] if postscale_factor != 1.0 else results
    return adasum_async(tensors, name, False, prescale_factor, postscale_factor).wait()


class _DeltaSteps:
    """Horovod's delta-based step for Adasum: each rank steps its own optimizer from the
    same parameters, the steps taken (new parameters minus old) are combined by Adasum, and
    every rank applies the combined step to the parameters it started from.

    The local step uses this rank's gradients as they are (summed over its backward
    passes): nothing is reduced before the step, and the optimizer's state stays local.
    """

    _adasum_names: dict[int, str]

    def step(self, closure: Any = None) -> Any:
        params = [
            p
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad  # type: ignore[attr-defined]
        ]
        starts = [p.detach().clone() for p in params]
        loss = super().step(closure)  # type: ignore[misc]
        deltas = []
        with torch.no_grad():
            for p, start in zip(params, starts, strict=True):
                deltas.append(p.detach().sub(start).contiguous())
        names = [self._adasum_names.get(id(p)) for p in params]
        handles = [
            adasum_async([delta], name, in_place=True)
            for delta, name in zip(deltas, names, strict=True)
        ]
        with torch.no_grad():
            for p, start, handle in zip(params, starts, handles, strict=True):
                (combined,) = handle.wait()
                p.copy_(start.add_(combined))
        return loss

    def synchronize(self) -> None:
        """Nothing to do: the deltas are combined inside `step()`."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(
            "skip_synchronize() has no meaning with op=hvd.Adasum: the optimizer combines the "
            "ranks' steps inside step(), not their gradients before it."
        )
        yield  # pragma: no cover


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    backward_passes_per_step: int = 1,
) -> torch.optim.Optimizer:
    """`optimizer`, made to combine the ranks' steps by Adasum (see `_DeltaSteps`).

    Parameter names (from `named_parameters`, else "adasum.noname.N" in the order of the
    param groups) name each parameter's reduction; they must be unique.
    """
    check_size()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not isinstance(item, tuple) for item in named):
            raise ValueError(
                "named_parameters should be a sequence of (name, parameter) tuples, usually "
                "model.named_parameters()."
            )
        seen: set[str] = set()
        duplicates = sorted({k for k, _ in named if k in seen or seen.add(k)})
        if duplicates:
            raise ValueError(
                "Parameter names in named_parameters must be unique; found duplicates: "
                + ", ".join(duplicates)
            )
        names = {id(p): f"adasum.{k}" for k, p in named}
        unnamed = [p for p in params if id(p) not in names]
        if unnamed:
            raise ValueError(
                f"named_parameters was given, but {len(unnamed)} parameter(s) of the optimizer "
                "are not in it: name every parameter (model.named_parameters())."
            )
    else:
        names = {id(p): f"adasum.noname.{index}" for index, p in enumerate(params)}
    cls = optimizer.__class__
    optimizer.__class__ = type(cls.__name__, (_DeltaSteps, cls), {})
    optimizer._adasum_names = names  # type: ignore[attr-defined]
    optimizer.backward_passes_per_step = backward_passes_per_step  # type: ignore[attr-defined]
    optimizer._parameter_names = {p: names[id(p)] for p in params}  # type: ignore[attr-defined]
    return optimizer
