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

    In a TF1 graph each collective op holds one of the session's inter-op threads while it
    waits for the other ranks, so with TensorFlow's default of one thread per core a
    ``session.run`` with more concurrent collectives than cores could leave every thread
    waiting on ops the other rank has not reached. Unless ``TF_NUM_INTEROP_THREADS`` is
    set, it is set here to at least 64 (TensorFlow reads it when it starts its thread
    pools): call `init` before the first TensorFlow operation. Called later, it warns: the
    pools are fixed by then, and such a ``session.run`` could wait until ``RINGPLUG_TIMEOUT``.
    """
    if "TF_NUM_INTEROP_THREADS" not in os.environ:
        threads = max(64, os.cpu_count() or 1)
        os.environ["TF_NUM_INTEROP_THREADS"] = str(threads)
        try:
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:  # TensorFlow already ran an operation: its pools are fixed
            warnings.warn(
                "ringplug.tensorflow.init() ran after TensorFlow's first operation, so its "
                "inter-op thread pool keeps its size: a TF1 session.run of more concurrent "
                "collectives than that can wait for the other ranks until RINGPLUG_TIMEOUT. "
                "Call init() (hvd.init()) before the first TensorFlow operation, or set "
                "TF_NUM_INTEROP_THREADS.",
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
