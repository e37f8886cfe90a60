"""ringplug for TensorFlow: collectives on tensors, a distributed gradient tape, and starting
every rank from the same variables.

``import ringplug.tensorflow`` imports TensorFlow; ``import ringplug`` alone never does.
The collectives run eagerly and inside ``tf.function`` (or a TF1 graph session), where
they become graph ops; see `ringplug.tensorflow.collectives` for how ranks match them and
what a mismatch raises (``tf.errors.FailedPreconditionError``).

Example:
    >>> import tensorflow as tf, ringplug.tensorflow as rtf  # doctest: +SKIP
    >>> rtf.init()
    >>> rtf.broadcast_variables(model.variables, root_rank=0)
    >>> @tf.function
    ... def step(images, labels):
    ...     with rtf.DistributedGradientTape() as tape:
    ...         loss = loss_fn(labels, model(images, training=True))
    ...     grads = tape.gradient(loss, model.trainable_variables)
    ...     optimizer.apply_gradients(zip(grads, model.trainable_variables))
"""

from __future__ import annotations

import os
import warnings

import tensorflow as tf

from .. import core
from ..compression import Compression
from ..core import Average, Max, Min, Product, Sum, local_rank, local_size, rank, shutdown, size
from . import _kernel
from .collectives import (
    BroadcastVariablesHook,
    TensorHandle,
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_async,
    grouped_broadcast,
    grouped_reducescatter,
    join,
    reducescatter,
    reducescatter_async,
)
from .sync_batch_norm import SyncBatchNormalization
from .tape import DistributedGradientTape, reduce_gradients


def init() -> None:
    """Start ringplug (MPI) on every rank, ready for TensorFlow graphs.

    Inside a ``tf.function`` or a TF1 graph each collective is an asynchronous op
    (`ringplug.tensorflow._kernel`): while it waits for the other ranks it holds none of
    TensorFlow's inter-op threads, so a ``session.run`` may hold any number of collectives,
    in any order, whatever the size of the pool. Where that op cannot be registered (see
    the warning it logs), a collective blocks a thread while it waits; then, unless
    ``TF_NUM_INTEROP_THREADS`` is set, it is set here to at least 64 (TensorFlow reads it
    when it starts its pools, so call `init` before the first TensorFlow operation; later
    it warns).
    """
    if not _kernel.available() and "TF_NUM_INTEROP_THREADS" not in os.environ:
        threads = max(64, os.cpu_count() or 1)
        os.environ["TF_NUM_INTEROP_THREADS"] = str(threads)
        try:
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:  # TensorFlow already ran an operation: its pools are fixed
            warnings.warn(
                "ringplug.tensorflow.init() ran after TensorFlow's first operation, and "
                f"graph collectives block a thread while they wait ({_kernel.why_not()}), "
                "so a TF1 session.run of more concurrent collectives than TensorFlow's "
                "inter-op threads can wait for the other ranks until RINGPLUG_TIMEOUT. "
                "Call init() (hvd.init()) before the first TensorFlow operation, or set "
                "TF_NUM_INTEROP_THREADS above the number of collectives a step runs.",
                stacklevel=2,
            )
    core.init()


__all__ = [
    "Average",
    "BroadcastVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "Max",
    "Min",
    "Product",
    "Sum",
    "SyncBatchNormalization",
    "TensorHandle",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_variables",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "grouped_broadcast",
    "grouped_reducescatter",
    "init",
    "join",
    "local_rank",
    "local_size",
    "rank",
    "reduce_gradients",
    "reducescatter",
    "reducescatter_async",
    "shutdown",
    "size",
]
