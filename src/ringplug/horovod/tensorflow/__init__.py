"""Horovod's ``horovod.tensorflow`` API on ringplug: ``import ringplug.horovod.tensorflow as
hvd``.

Horovod's names and signatures over `ringplug.tensorflow`, which does the work: the
collectives take and return TensorFlow tensors eagerly, inside ``tf.function`` and in TF1
graphs, are differentiable as Horovod's, and fail with ``tf.errors.FailedPreconditionError``
when the ranks disagree. `hvd.init` is ``ringplug.tensorflow.init``.

``process_set=`` runs an operation among a set's members on the set's own engine
(`_common.on_process_set`), with root ranks counted in the world, as Horovod's; a rank
outside the set, or a root outside it, gets ``tf.errors.InvalidArgumentError`` at once, as
Horovod's ops raise it. Inside a graph the op keeps the set for each time it runs, and
gradients run on the set their forward ran on (`ringplug.tensorflow._ops`).
"""

from __future__ import annotations

import functools
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
    ProcessSet,
    ProcessSetArgumentError,
    global_process_set,
    local_layers_variables,
    on_process_set,
    resolve_op,
)
from .._common import __all__ as _BASICS
from . import adasum as _adasum
from . import mpi_ops, util  # noqa: F401 - hvd.mpi_ops, as Horovod
from .util import _executing_eagerly  # noqa: F401 - hvd._executing_eagerly, as Horovod

Compression = _tf.Compression
SyncBatchNormalization = _tf.SyncBatchNormalization


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start ringplug (`ringplug.tensorflow.init`) and register `process_sets` (a list of
    `ProcessSet` objects or lists of ranks, or ``"dynamic"``) on every rank; `comm` is
    refused."""
    _common.init(comm, process_sets)
    _tf.init()


def _as_tf_errors(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, whose process-set refusals (this rank not a member, a root outside the
    set) are ``tf.errors.InvalidArgumentError``, as Horovod's TensorFlow ops raise them."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except ProcessSetArgumentError as error:
            raise tf.errors.InvalidArgumentError(None, None, str(error)) from None

    return call


def _on_set(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (taking `process_set`, maybe `root_rank`) run on the set's engine."""
    return _as_tf_errors(on_process_set(function))


def _refuse_adasum_on_set() -> None:
    """As Horovod: Adasum runs over all ranks only (`on_process_set` has entered a set's
    scope when process_set= named one)."""
    if core.runtime.scope.get() is not None:
        raise NotImplementedError(
            "Adasum does not support non-global process sets yet: leave process_set at "
            "hvd.global_process_set with op=hvd.Adasum, or use op=hvd.Average on the set."
        )


barrier = _as_tf_errors(_common.barrier)
broadcast_object = _as_tf_errors(_common.broadcast_object)
allgather_object = _as_tf_errors(_common.allgather_object)


@_on_set
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
    """The reduction of `tensor` (or ``tf.IndexedSlices``) over every rank of `process_set`;
    Average when no op is given (op=hvd.Adasum: on a power of two ranks, all of them).
    Differentiable."""
    scales = (prescale_factor, postscale_factor)
    if op is Adasum:
        _refuse_adasum_on_set()
        return _adasum.reduce_compressed([tensor], compression, *scales, name)[0]
    return reduce_compressed([tensor], resolve_op(average, op), compression, *scales, name)[0]


@_on_set
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
    scales = (prescale_factor, postscale_factor)
    if op is Adasum:
        _refuse_adasum_on_set()
        return _adasum.reduce_compressed(list(tensors), compression, *scales, name)
    return reduce_compressed(list(tensors), resolve_op(average, op), compression, *scales, name)


@_on_set
def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: Any = _SET
) -> Any:
    """Every rank's `tensor` concatenated on the first dimension. Differentiable."""
    return _tf.allgather(tensor, name=name)


@_on_set
def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = _SET,
) -> list[Any]:
    """`allgather` of several tensors together; returns them in order."""
    return _tf.grouped_allgather(tensors, name=name)


@_on_set
def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = _SET,
) -> Any:
    """Root's `tensor` on every rank. Differentiable."""
    return _tf.broadcast(tensor, root_rank, name=name)


@_on_set
def broadcast_(
    variables: Sequence[Any], root_rank: int, name: str | None = None, process_set: Any = _SET
) -> list[Any]:
    """Assign root's values to `variables` in place; returns their new values."""
    variables = list(variables)
    values = _tf.grouped_broadcast(
        [v.read_value() if hasattr(v, "read_value") else v for v in variables], root_rank, name=name
    )
    return [variable.assign(value) for variable, value in zip(variables, values, strict=True)]


@_on_set
def broadcast_variables(
    variables: Sequence[Any], root_rank: int, process_set: Any = _SET, inplace: bool = False
) -> Any:
    """Assign root's values to `variables` on every rank of `process_set` (eagerly at once;
    in a graph, the returned op does it)."""
    return _tf.broadcast_variables(variables, root_rank)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graphs: an op assigning root's values to every global variable."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not work eagerly (there are no global "
            "variables); use hvd.broadcast_variables(model.variables, root_rank=0)."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


@_on_set
def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = _SET,
) -> Any:
    """Rows ``splits[i]`` of `tensor` to rank i (an even split without `splits`); the rows
    received, and with `splits` also the int32 counts received (as Horovod)."""
    received, counts = _tf.alltoall(tensor, splits, name=name)
    return (received, counts) if splits is not None else received


@_on_set
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


@_on_set
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
    factors = {"prescale_factor": prescale_factor, "postscale_factor": postscale_factor}
    return compressed(
        compression,
        [tf.convert_to_tensor(t) for t in tensors],
        lambda ts: _tf.grouped_reducescatter(ts, resolve_op(None, op), name=name, **factors),
    )


join = _tf.join


def _registered_set(process_set_id: int, what: str) -> ProcessSet:
    if process_set_id == 0:
        return global_process_set
    found = _common._registered.get(process_set_id)
    if found is None:
        raise ValueError(
            f"hvd.{what}: there is no process set {process_set_id} (registered: "
            f"{sorted(_common._registered)}); pass the process_set_id of a registered set."
        )
    return found


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """The number of ranks (of the process set `process_set_id`), as a tensor."""
    size = _registered_set(process_set_id, "size_op").size()
    return tf.constant(size, dtype=tf.int32, name=name)


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
    """1 if this rank is in the process set `process_set_id`, else 0, as a tensor."""
    included = _registered_set(process_set_id, "process_set_included_op").included()
    return tf.constant(1 if included else 0, dtype=tf.int32, name=name)


def broadcast_object_fn(
    root_rank: int = 0, session: Any = None, name: str | None = None, process_set: Any = _SET
) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from root (Horovod's TF1 form), among
    `process_set`'s ranks (`root_rank` a world rank)."""
    return lambda obj: broadcast_object(obj, root_rank, name=name, process_set=process_set)


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
    returns gradients averaged over every rank of `process_set` (on a rank outside the
    set, its own gradients, as Horovod)."""
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
    local_variables = local_layers_variables(local_layers)
    if process_set is not _SET and process_set is not None:
        if op is Adasum:
            raise NotImplementedError(
                "Adasum does not support non-global process sets yet: use op=hvd.Average "
                "with process_set=, or op=hvd.Adasum on all ranks."
            )
        if not _is_member(process_set, "DistributedGradientTape"):
            return _UnreducedTape(gradtape)
        return _on_set(_tape_on_set)(
            gradtape,
            resolve_op(None, op),
            compression,
            sparse_as_dense,
            gradient_predivide_factor,
            local_variables,
            scale_local_gradients,
            process_set=process_set,
        )
    if op is Adasum:
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor applies to op=hvd.Average only.")
        _adasum.check_size()
        return _adasum.AdasumGradientTape(
            gradtape,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            local_variables=local_variables,
            scale_local_gradients=scale_local_gradients,
        )
    return _tape_on_set(
        gradtape,
        resolve_op(None, op),
        compression,
        sparse_as_dense,
        gradient_predivide_factor,
        local_variables,
        scale_local_gradients,
    )


def _is_member(process_set: Any, what: str) -> bool:
    """Whether this rank is in the registered `process_set` (ValueError: not registered)."""
    try:
        _common._member_engine(process_set, what)
    except ProcessSetArgumentError:
        return False
    return True


def _tape_on_set(
    gradtape: tf.GradientTape,
    op: Any,
    compression: Any,
    sparse_as_dense: bool,
    gradient_predivide_factor: float,
    local_variables: list[Any],
    scale_local_gradients: bool,
    process_set: Any = _SET,
) -> _tf.DistributedGradientTape:
    """The tape, made on the current engine (a set's, inside `on_process_set`): it reduces
    there whenever ``gradient()`` is called."""
    return _tf.DistributedGradientTape(
        gradtape,
        op=op,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        local_variables=local_variables,
        scale_local_gradients=scale_local_gradients,
    )


class _UnreducedTape(_tf.DistributedGradientTape):
    """A rank outside a tape's process set: its gradients are its own (Horovod's)."""

    def _reduce(self, grads: list[Any]) -> list[Any]:
        return list(grads)


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
    """A Keras optimizer averaging its gradients over every rank of `process_set`
    (``ringplug.keras``'s DistributedOptimizer), or a ``tf.compat.v1.train`` optimizer whose
    ``compute_gradients`` returns them averaged (TF1 graphs). On a rank outside
    `process_set`, the optimizer steps on its own gradients, as Horovod."""
    if op is Adasum:
        raise ValueError(
            "op=hvd.Adasum is not taken by Keras optimizers (nor by Horovod's); use "
            "hvd.DistributedGradientTape(tape, op=hvd.Adasum) in a custom training loop, "
            "or op=hvd.Average."
        )
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise NotImplementedError(
                "ringplug.horovod.tensorflow reduces a tf.compat.v1.train optimizer's "
                "gradients at every compute_gradients(); leave backward_passes_per_step at "
                "1, or move to Keras (tf.keras.optimizers), which accumulates them."
            )
        reduces = process_set in (_SET, None) or _is_member(process_set, "DistributedOptimizer")
        if not reduces:
            return _TF1Optimizer(optimizer, name, use_locking, None)
        settings = (resolve_op(None, op), compression, sparse_as_dense, gradient_predivide_factor)
        if process_set in (_SET, None):
            return _TF1Optimizer(optimizer, name, use_locking, settings)
        return _on_set(_TF1Optimizer)(
            optimizer, name, use_locking, settings, process_set=process_set
        )
    from ..keras import DistributedOptimizer as _keras_optimizer

    return _keras_optimizer(
        optimizer,
        compression=compression,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        process_set=process_set,
    )


class _TF1Optimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train`` optimizer whose `compute_gradients` returns the gradients
    reduced among the ranks of the engine current when it was made (a process set's inside
    `on_process_set`); `settings` None: left as they are (a rank outside the set)."""

    def __init__(
        self,
        optimizer: tf.compat.v1.train.Optimizer,
        name: str | None,
        use_locking: bool,
        settings: tuple[Any, Any, bool, float] | None,
        process_set: Any = _SET,
    ) -> None:
        super().__init__(use_locking, name or f"Distributed{type(optimizer).__name__}")
        self._optimizer = optimizer  # Horovod's attribute name
        self._settings = settings
        self._engine = core.runtime.scope.get()

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if self._settings is None or not pairs:
            return pairs
        op, compression, sparse_as_dense, predivide = self._settings
        token = core.runtime.scope.set(self._engine)
        try:
            reduced = _tf.reduce_gradients(
                [g for g, _ in pairs],
                op,
                compression=compression,
                sparse_as_dense=sparse_as_dense,
                gradient_predivide_factor=predivide,
            )
        finally:
            core.runtime.scope.reset(token)
        return list(zip(reduced, [v for _, v in pairs], strict=True))

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


class BroadcastGlobalVariablesHook(_tf.BroadcastVariablesHook):
    """`ringplug.tensorflow.BroadcastVariablesHook` under Horovod's name and arguments."""

    def __init__(self, root_rank: int, device: str = "", process_set: Any = _SET) -> None:
        _on_set(_start_hook)(self, root_rank, process_set=process_set)


def _start_hook(hook: _tf.BroadcastVariablesHook, root_rank: int, process_set: Any = _SET) -> None:
    """The hook, made on the current engine (a set's: it broadcasts among its ranks)."""
    _tf.BroadcastVariablesHook.__init__(hook, root_rank)


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
