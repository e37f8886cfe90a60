"""DistributedOptimizer: averages gradients over ranks while backward is still running.

The class it builds is the user's optimizer class with a mixin: `ringplug.torch.averaging`
(gradient buckets reduced in place while backward runs), or, with ``zero=1|2``,
`ringplug.torch.zero` (each rank steps its shard of the parameters).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..compression import Compression
from ..core import runtime
from ..core.ops import Average, ReduceOp, as_op
from .averaging import DEFAULT_BUCKET_BYTES, _Distributed
from .buffers import BufferSync


def DistributedOptimizer(  # noqa: N802 - reads like a class, as in Horovod
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    backward_passes_per_step: int = 1,
    compression: Compression | str = Compression.none,
    op: ReduceOp | str = Average,
    gradient_predivide_factor: float = 1.0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    module: torch.nn.Module | None = None,
    zero: int = 0,
    zero_layout: str = "whole",
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that its gradients are averaged over every rank before each step.

    Args:
        optimizer: any torch optimizer, already built over the model's parameters.
        named_parameters: ``model.named_parameters()``, to name gradients in errors and the
            timeline; the names must be unique. Defaults to ``None`` (named by position).
        backward_passes_per_step: backward passes whose gradients accumulate locally before
            one reduction (gradient accumulation). Defaults to 1.
        compression: `Compression.none` (default) or `Compression.fp16` (or its value,
            ``"fp16"``).
        op: `Average` (default) or `Sum`.
        gradient_predivide_factor: divide by this before the sum and by size/this after
            (Average only), to keep float16 sums in range. Defaults to 1.0.
        bucket_bytes: size of the gradient buckets reduced as one. Defaults to 25 MiB.
        module: the model, if you want its buffers kept equal: rank 0's buffers
            (BatchNorm's running statistics) go to every rank with the last gradients of
            each step, so the ranks end each step with the same buffers, and before any
            other forward that follows a training forward, as DDP's ``broadcast_buffers``
            (`ringplug.torch.buffers.BufferSync`); its parameter names also name the
            gradients when `named_parameters` is not given. Defaults to ``None``: buffers
            are each rank's own, as in Horovod.
        zero: shard the optimizer state over the ranks (ZeRO, see `ringplug.torch.zero`):
            ``0`` (default) every rank steps every parameter; ``1`` each rank keeps the
            optimizer state of its shard of the parameters only, steps it, and the updated
            weights are gathered back; ``2`` also keeps only its shard of the averaged
            gradients (reduced straight to their owners while backward runs).
        zero_layout: how the parameters are shared out with ``zero=1|2``: ``"whole"``
            (default) each parameter tensor has one owner, for every optimizer;
            ``"flat"`` each rank steps an equal slice of each gradient bucket, cutting
            tensors apart (faster collectives; only for optimizers that update each
            element on its own, as SGD, Adam, AdamW, RMSprop, Adagrad; CPU only).

    Returns:
        An optimizer of a subclass of `optimizer`'s class, with the same parameter groups
        and state, plus `synchronize()` and `skip_synchronize()`. Each `step()` counts
        into the rank's position, so a stall report says where it is ("at step 5").

    Example:
        >>> optimizer = ringplug.torch.DistributedOptimizer(  # doctest: +SKIP
        ...     torch.optim.SGD(model.parameters(), lr=0.1 * ringplug.size()),
        ...     named_parameters=model.named_parameters())
    """
    runtime.engine()  # fail early, with the right message, before init()
    mixin: type = _Distributed
    if zero:
        from .zero import _Sharded, check_shardable  # imports this module

        check_shardable(optimizer, zero, Compression(compression), zero_layout)
        mixin = _Sharded
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    distributed = cls.__new__(cls)
    distributed.__dict__.update(optimizer.__dict__)  # same param_groups, state and hooks
    _retarget_scheduler_patch(distributed)
    if module is not None and named_parameters is None:
        named_parameters = _names_from(module, optimizer)
    distributed._ringplug_setup(
        named_parameters,
        backward_passes_per_step,
        Compression(compression),
        as_op(op),
        float(gradient_predivide_factor),
        int(bucket_bytes),
    )
    if zero:
        distributed._ringplug_shard(int(zero), zero_layout)
    if module is not None and runtime.size() > 1:
        sync = BufferSync(module, name="optimizer.buffers")
        if sync.buffers:
            distributed._ringplug_hooks.append(sync)  # detach_hooks removes it too
            distributed._ringplug_companions.append(sync.start)
        else:
            sync.remove()
    return distributed


def _names_from(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.nn.Parameter]] | None:
    """`module`'s names for the optimizer's parameters, or None if it lacks some of them."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = [(name, p) for name, p in module.named_parameters() if id(p) in wanted]
    return named if len(named) == len(wanted) else None


def _retarget_scheduler_patch(distributed: Any) -> None:
    """An LR scheduler made before wrapping patched the original optimizer's ``step`` (to
    notice the first call), through a weak reference to that original: copied as it is, it
    would step the original, past the reduction, or fail once the original is collected.
    Patch the distributed optimizer's own step the same way instead."""
    patched = distributed.__dict__.pop("step", None)
    if patched is None or not getattr(patched, "_wrapped_by_lr_sched", False):
        if patched is not None:
            distributed.step = patched  # somebody else's override: keep it
        return
    owner = weakref.ref(distributed)

    def step(*args: Any, **kwargs: Any) -> Any:
        optimizer = owner()
        optimizer._opt_called = True  # what the scheduler's patch records
        return type(optimizer).step(optimizer, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    distributed.step = step
