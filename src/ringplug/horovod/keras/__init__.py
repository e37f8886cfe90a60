"""Horovod's Keras API on ringplug, working on Keras 3: ``import ringplug.horovod.keras as
hvd`` (also ``ringplug.horovod.tensorflow.keras``).

The callbacks are in ``hvd.callbacks`` under Horovod's names, Horovod's elastic API in
``hvd.elastic`` (`ringplug.horovod.keras.elastic`, on ringrun's restarts). Collectives take
and return the backend's tensors, through `ringplug.tensorflow` (inside ``tf.function``
too) or `ringplug.torch`, and through the core's numpy form on JAX (eagerly).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from ... import core
from ...compression import Compression, compressed
from ...keras import DistributedOptimizer as _DistributedOptimizer
from ...keras._reduce import broadcast_variables as _broadcast_variables
from ...keras.optimizer import set_local_variables as _set_local_variables
from .. import _common
from .._common import *  # noqa: F403 - Horovod's basics, re-exported
from .._common import (
    _SET,
    Average,
    allgather_object,
    broadcast_object,
    local_layers_variables,
    on_process_set,
    resolve_op,
)
from .._common import __all__ as _BASICS
from . import callbacks, elastic


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start ringplug (on the TensorFlow backend as `ringplug.tensorflow.init` does) and
    register `process_sets` on every rank, as `ringplug.horovod.tensorflow.init`."""
    _common.init(comm, process_sets)
    if keras.backend.backend() == "tensorflow":
        from ... import tensorflow as _tf

        _tf.init()


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
    process_set: Any = _SET,
) -> keras.optimizers.Optimizer:
    """Average gradients over the ranks of `process_set` (every rank by default) before
    each update (ringplug.keras's optimizer: one fused reduction per step, before clipping;
    safe under mixed precision). On a rank outside `process_set`, the optimizer steps on
    its own gradients, as Horovod; every rank still calls this."""
    if gradient_predivide_factor != 1.0:
        raise NotImplementedError(
            "ringplug.horovod.keras does not implement gradient_predivide_factor; leave it at 1.0."
        )
    args = (optimizer, resolve_op(None, op), backward_passes_per_step, compression)
    if process_set is _SET or process_set is None:
        return _DistributedOptimizer(*args)
    try:
        _common._member_engine(process_set, "DistributedOptimizer")
    except _common.ProcessSetArgumentError:
        distributed = _DistributedOptimizer(*args)
        distributed._ringplug.enabled = False  # outside the set: its own gradients
        return distributed
    return on_process_set(_optimizer_on_set)(*args, process_set=process_set)


def _optimizer_on_set(*args: Any, process_set: Any = _SET) -> keras.optimizers.Optimizer:
    """ringplug.keras's optimizer, made on the current engine (a set's): it reduces there."""
    return _DistributedOptimizer(*args)


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name
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
    groups: Any = None,
    process_set: Any = _SET,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """`DistributedOptimizer` that leaves the gradients of `local_layers`' variables local
    (each rank trains its own copy of those layers; divided by the number of ranks with
    `scale_local_gradients`, as Horovod); the others are averaged."""
    distributed = DistributedOptimizer(
        optimizer,
        compression=compression,
        op=op,
        process_set=process_set,
        gradient_predivide_factor=gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step,
    )
    in_set = process_set is not _SET and process_set is not None and process_set.included()
    ranks = process_set.size() if in_set else core.size()
    _set_local_variables(
        distributed,
        local_layers_variables(local_layers),
        1.0 / ranks if scale_local_gradients else 1.0,
    )
    return distributed


def load_model(
    filepath: Any,
    custom_optimizers: Any = None,
    custom_objects: dict | None = None,
    compression: Any = Compression.none,
    legacy_opts: bool = False,
) -> keras.Model:
    """Load a saved Keras model and make its optimizer a `DistributedOptimizer`, keeping its
    state (Horovod's ``hvd.load_model``). `custom_optimizers` are optimizer classes the file
    may name; `legacy_opts` is refused (Keras 3 has no legacy optimizers)."""
    if legacy_opts:
        raise NotImplementedError(
            "Keras 3 has no keras.optimizers.legacy; load with legacy_opts=False."
        )
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects.setdefault(cls.__name__, cls)
    model = keras.saving.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is not None:
        DistributedOptimizer(model.optimizer, compression=compression)
    return model


def broadcast_global_variables(root_rank: int) -> None:
    """Refused on Keras 3 (there are no global variables): broadcast a model's."""
    raise RuntimeError(
        "hvd.broadcast_global_variables() has no global variables to broadcast on Keras 3; "
        "use hvd.callbacks.BroadcastGlobalVariablesCallback(0) in fit(), or "
        "hvd.broadcast_variables(model.variables, root_rank=0)."
    )


@on_process_set
def broadcast_variables(variables: Any, root_rank: int, process_set: Any = _SET) -> None:
    """Assign root's values to `variables` on every rank of `process_set` (`root_rank` a
    world rank)."""
    _broadcast_variables(list(variables), root_rank)


def _collective(kind: str, value: Any, *args: Any, **kwargs: Any) -> Any:
    """`kind` of the backend tensor `value` by the backend's adapter (`ringplug.tensorflow`,
    inside ``tf.function`` too, or `ringplug.torch`), or by the core on its numpy value."""
    tensor, backend = keras.ops.convert_to_tensor(value), keras.backend.backend()
    if backend == "tensorflow":
        from ... import tensorflow as adapter
    elif backend == "torch":
        from ... import torch as adapter
    else:
        return keras.ops.convert_to_tensor(getattr(core, kind)(np.asarray(tensor), *args, **kwargs))
    return getattr(adapter, kind)(tensor, *args, **kwargs)


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Any = None,
    compression: Any = Compression.none,
) -> Any:
    """The reduction of `value` over every rank, as a backend tensor."""
    reduce_op = resolve_op(average, op)

    def reduce(sent: list) -> list:
        scales = {"prescale_factor": prescale_factor, "postscale_factor": postscale_factor}
        return [_collective("allreduce", sent[0], reduce_op, name=name, **scales)]

    return compressed(compression, [keras.ops.convert_to_tensor(value)], reduce)[0]


def allgather(value: Any, name: str | None = None) -> Any:
    """Every rank's `value` concatenated on the first dimension (which may differ)."""
    return _collective("allgather", value, name=name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """Root's `value` on every rank."""
    return _collective("broadcast", value, root_rank, name=name)


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> Any:
    """This rank's block of rows of the reduction of `value` over every rank."""
    return _collective("reducescatter", value, resolve_op(None, op), name=name)


__all__ = [
    *_BASICS,
    "Compression",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "allgather",
    "allgather_object",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "elastic",
    "load_model",
    "reducescatter",
]
