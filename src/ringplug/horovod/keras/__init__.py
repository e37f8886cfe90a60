"""Horovod's Keras API on ringplug, working on Keras 3: ``import ringplug.horovod.keras as
hvd`` (also ``ringplug.horovod.tensorflow.keras``).

The callbacks are in ``hvd.callbacks`` under Horovod's names. Collectives take and return
the backend's tensors.
"""

from __future__ import annotations

from typing import Any

import keras

from ... import core
from ...keras import DistributedOptimizer as _DistributedOptimizer
from ...keras.callbacks import broadcast_variables as _broadcast_variables
from .._common import *  # noqa: F403 - Horovod's basics, re-exported
from .._common import Average, check_process_set, global_process_set, resolve_op
from .._common import __all__ as _BASICS
from . import callbacks


class Compression:
    """``hvd.Compression.none`` / ``hvd.Compression.fp16`` (the gradients on the wire)."""

    none = "none"
    fp16 = "fp16"


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
) -> keras.optimizers.Optimizer:
    """Average gradients over ranks before each update (ringplug.keras's optimizer: one
    fused reduction per step, before clipping; safe under mixed precision)."""
    check_process_set(process_set)
    if gradient_predivide_factor != 1.0:
        raise NotImplementedError(
            "ringplug.horovod.keras does not implement gradient_predivide_factor; leave it at 1.0."
        )
    return _DistributedOptimizer(
        optimizer,
        op=resolve_op(None, op),
        backward_passes_per_step=backward_passes_per_step,
        compression="fp16" if compression == Compression.fp16 else None,
    )


def broadcast_variables(
    variables: Any, root_rank: int, process_set: Any = global_process_set
) -> None:
    """Assign root's values to `variables` on every rank."""
    check_process_set(process_set)
    _broadcast_variables(list(variables), root_rank)


def _tensor(value: Any) -> Any:
    return keras.ops.convert_to_numpy(value)


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Any = None,
    compression: Any = Compression.none,
    process_set: Any = global_process_set,
) -> Any:
    """The reduction of `value` over every rank, as a backend tensor."""
    check_process_set(process_set)
    result = core.allreduce(
        _tensor(value),
        resolve_op(average, op),
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )
    return keras.ops.convert_to_tensor(result)


def allgather(value: Any, name: str | None = None, process_set: Any = global_process_set) -> Any:
    """Every rank's `value` concatenated on the first dimension (which may differ)."""
    check_process_set(process_set)
    return keras.ops.convert_to_tensor(core.allgather(_tensor(value), name=name))


def broadcast(
    value: Any, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Root's `value` on every rank."""
    check_process_set(process_set)
    return keras.ops.convert_to_tensor(core.broadcast(_tensor(value), root_rank, name=name))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    return core.broadcast_object(obj, root_rank, name=name)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    return core.allgather_object(obj, name=name)


__all__ = [
    *_BASICS, "Compression", "DistributedOptimizer", "allgather", "allgather_object",
    "allreduce", "broadcast", "broadcast_object", "broadcast_variables", "callbacks",
]  # fmt: skip
