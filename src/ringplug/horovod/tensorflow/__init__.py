"""Horovod's ``horovod.tensorflow`` API on ringplug: ``import ringplug.horovod.tensorflow as
hvd``.

Horovod's names and signatures over `ringplug.tensorflow`, which does the work: the
collectives take and return TensorFlow tensors eagerly, inside ``tf.function`` and in TF1
graphs, are differentiable as Horovod's, and fail with ``tf.errors.FailedPreconditionError``
when the ranks disagree. `hvd.init` is ``ringplug.tensorflow.init``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from ... import core
from ... import tensorflow as _tf
from ...compression import compressed
from ...tensorflow.tape import reduce_compressed
from .. import _common
from .._common import *  # noqa: F403 - Horovod's basics, re-exported
from .._common import (
    _SET,
    Adasum,
    Average,
    allgather_object,
    barrier,
    broadcast_object,
    check_process_set,
    local_layers_variables,
    resolve_op,
)
from .._common import __all__ as _BASICS
from . import adasum as _adasum
from . import util
from .util import _executing_eagerly  # noqa: F401 - hvd._executing_eagerly, as Horovod

Compression = _tf.Compression
SyncBatchNormalization = _tf.SyncBatchNormalization


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start ringplug (`ringplug.tensorflow.init`); `comm` and `process_sets` are refused."""
    _common.init(comm, process_sets)  # refuses them, then starts the core
    _tf.init()


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: Any = _SET,
    ignore_name_scope: bool = False,
) -> Any:
    """The reduction of `tensor` (or ``tf.IndexedSlices``) over every rank; Average when no
    op is given (op=hvd.Adasum: on a power of two ranks). Differentiable."""
    check_process_set(process_set)
    scales = (prescale_factor, postscale_factor)
    if op is Adasum:
        return _adasum.reduce_compressed([tensor], compression, *scales, name)[0]
    return reduce_compressed([tensor], resolve_op(average, op), compression, *scales, name)[0]


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = _SET,
    name: str | None = None,
    ignore_name_scope: bool = False,
) -> list[Any]:
    """Several tensors reduced together; returns them in order. Differentiable."""
    check_process_set(process_set)
    scales = (prescale_factor, postscale_factor)
    if op is Adasum:
        return _adasum.reduce_compressed(list(tensors), compression, *scales, name)
    return reduce_compressed(list(tensors), resolve_op(average, op), compression, *scales, name)


def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: Any = _SET
) -> Any:
    """Every rank's `tensor` concatenated on the first dimension. Differentiable."""
    check_process_set(process_set)
    return _tf.allgather(tensor, name=name)


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = _SET,
) -> list[Any]:
    """`allgather` of several tensors together; returns them in order."""
    check_process_set(process_set)
    return _tf.grouped_allgather(tensors, name=name)


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = _SET,
) -> Any:
    """Root's `tensor` on every rank. Differentiable."""
    check_process_set(process_set)
    return _tf.broadcast(tensor, root_rank, name=name)


def broadcast_(
    variables: Sequence[Any], root_rank: int, name: str | None = None, process_set: Any = _SET
) -> list[Any]:
    """Assign root's values to `variables` in place; returns their new values."""
    check_process_set(process_set)
    variables = list(variables)
    values = _tf.grouped_broadcast(
        [v.read_value() if hasattr(v, "read_value") else v for v in variables], root_rank, name=name
    )
    return [variable.assign(value) for variable, value in zip(variables, values, strict=True)]


def broadcast_variables(
    variables: Sequence[Any], root_rank: int, process_set: Any = _SET, inplace: bool = False
) -> Any:
    """Assign root's values to `variables` on every rank (eagerly at once; in a graph, the
    returned op does it)."""
    check_process_set(process_set)
    return _tf.broadcast_variables(variables, root_rank)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graphs: an op assigning root's values to every global variable."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not work eagerly (there are no global "
            "variables); use hvd.broadcast_variables(model.variables, root_rank=0)."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = _SET,
) -> Any:
    """Rows ``splits[i]`` of `tensor` to rank i (an even split without `splits`); the rows
    received, and with `splits` also the int32 counts received (as Horovod)."""
    check_process_set(process_set)
    received, counts = _tf.alltoall(tensor, splits, name=name)
    return (received, counts) if splits is not None else received


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    name: str | None = None,
    process_set: Any = _SET,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """This rank's block of rows of the reduction. Differentiable."""
    scales = {"prescale_factor": prescale_factor, "postscale_factor": postscale_factor}
    return grouped_reducescatter(
        [tensor], compression=compression, op=op, process_set=process_set, name=name, **scales
    )[0]


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = _SET,
    name: str | None = None,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[Any]:
    """`reducescatter` of several tensors together; returns the blocks in order."""
    check_process_set(process_set)
    factors = {"prescale_factor": prescale_factor, "postscale_factor": postscale_factor}
    return compressed(
        compression,
        [tf.convert_to_tensor(t) for t in tensors],
        lambda ts: _tf.grouped_reducescatter(ts, resolve_op(None, op), name=name, **factors),
    )


join = _tf.join


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """The number of ranks, as a tensor."""
    return tf.constant(core.size(), dtype=tf.int32, name=name)


def local_size_op(name: str | None = None) -> Any:
    """The number of ranks on this host, as a tensor."""
    return tf.constant(core.local_size(), dtype=tf.int32, name=name)


def rank_op(name: str | None = None) -> Any:
    """This rank, as a tensor."""
    return tf.constant(core.rank(), dtype=tf.int32, name=name)


def local_rank_op(name: str | None = None) -> Any:
    """This rank's index on its host, as a tensor."""
    return tf.constant(core.local_rank(), dtype=tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """1: every rank is in the (only, global) process set."""
    check_process_set(None if process_set_id == 0 else process_set_id)
    return tf.constant(1, dtype=tf.int32, name=name)


def broadcast_object_fn(
    root_rank: int = 0, session: Any = None, name: str | None = None, process_set: Any = _SET
) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from root (Horovod's TF1 form)."""
    check_process_set(process_set)
    return lambda obj: core.broadcast_object(obj, root_rank, name=name)


def DistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = _SET,
    scale_local_gradients: bool = True,
) -> _tf.DistributedGradientTape:
    """`gradtape` as a `ringplug.tensorflow.DistributedGradientTape`: ``gradient()``
    returns gradients averaged over every rank."""
    return PartialDistributedGradientTape(
        gradtape,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = _SET,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> _tf.DistributedGradientTape:
    """`DistributedGradientTape` that leaves the gradients of `local_layers`' variables
    local (model parallelism: each rank trains its own copy of those layers)."""
    check_process_set(process_set)
    if op is Adasum:
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor applies to op=hvd.Average only.")
        _adasum.check_size()
        return _adasum.AdasumGradientTape(
            gradtape,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            local_variables=local_layers_variables(local_layers),
            scale_local_gradients=scale_local_gradients,
        )
    return _tf.DistributedGradientTape(
        gradtape,
        op=resolve_op(None, op),
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        local_variables=local_layers_variables(local_layers),
        scale_local_gradients=scale_local_gradients,
    )


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = _SET,
) -> Any:
    """A Keras optimizer averaging its gradients over every rank (``ringplug.keras``'s
    DistributedOptimizer); ``tf.compat.v1.train`` optimizers are refused."""
    check_process_set(process_set)
    if op is Adasum:
        raise ValueError(
            "op=hvd.Adasum is not taken by Keras optimizers (nor by Horovod's); use "
            "hvd.DistributedGradientTape(tape, op=hvd.Adasum) in a custom training loop, "
            "or op=hvd.Average."
        )
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise NotImplementedError(
            "ringplug.horovod.tensorflow wraps Keras optimizers only; for a "
            "tf.compat.v1.train optimizer, reduce the gradients with "
            "hvd.grouped_allreduce(grads) between compute_gradients() and "
            "apply_gradients(), or move to Keras (tf.keras.optimizers)."
        )
    from ..keras import DistributedOptimizer as _keras_optimizer

    return _keras_optimizer(
        optimizer,
        compression=compression,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
    )


class BroadcastGlobalVariablesHook(_tf.BroadcastVariablesHook):
    """`ringplug.tensorflow.BroadcastVariablesHook` under Horovod's name and arguments."""

    def __init__(self, root_rank: int, device: str = "", process_set: Any = _SET) -> None:
        check_process_set(process_set)
        super().__init__(root_rank)


from . import elastic, keras  # noqa: E402 - hvd.keras and hvd.elastic, as Horovod's module has

__all__ = [
    *_BASICS,
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "elastic",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "join",
    "keras",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "reducescatter",
    "size_op",
    "util",
]
