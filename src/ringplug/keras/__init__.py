"""ringplug for Keras 3 (TensorFlow, torch and JAX backends).

``import ringplug.keras`` imports Keras; ``import ringplug`` alone never does. A training
script needs four additions::

    import ringplug.keras as rk

    rk.init()                                     # MPI, this rank's GPU and share of cores
    model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(rk.scale_lr(0.01))),
                  loss="sparse_categorical_crossentropy")
    model.fit(rk.shard(dataset).shuffle(1000).batch(32), epochs=10,
              callbacks=[rk.RingMetricAverage(), rk.RingBroadcast(0), rk.RingWarmup(3),
                         *rk.on_rank_zero(keras.callbacks.ModelCheckpoint("best.keras"))],
              verbose=rk.verbose())

A ``keras.callbacks.BackupAndRestore(dir, save_freq=N)`` beside `RingBroadcast` becomes
`BackupAndRestore`: rank 0 writes, every rank restores, mid-epoch with `bucketed_dataset`,
and SIGTERM saves before the ranks stop (so ``ringrun --max-restarts`` resumes a fit).
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from .. import core
from ..core.ops import Average, Sum
from ._devices import pin_local_gpu
from .agreement import RanksDisagreeError, check_agreement
from .backup import BackupAndRestore, Preempted
from .callbacks import (
    ConsolidateForCheckpoints,
    RingBroadcast,
    RingMetricAverage,
    RingWarmup,
    WarmupSchedule,
    broadcast_variables,
)
from .data import ShardedPyDataset, bucketed_dataset, shard
from .diagnostics import RingDiagnose
from .optimizer import DistributedOptimizer
from .schedule import RingSchedule
from .sharding import consolidate


def init() -> None:
    """Start ringplug (MPI), put this rank on its own GPU, and give it its share of the
    host's cores.

    - GPU: local rank i computes on GPU i of its host, alone (TensorFlow: only that GPU
      visible, with memory growth; JAX: ``jax_cuda_visible_devices``; torch: ``cuda:i``
      as the current device). A rank with no GPU of its own is an error that says what
      to do; where each rank sees one GPU (CUDA_VISIBLE_DEVICES per rank), it takes it.
    - CPU: TensorFlow's and torch's thread pools get cores // ranks-on-this-host threads
      unless ``OMP_NUM_THREADS`` is set.

    Call it at the top of the script, before the first TensorFlow or JAX operation (they
    fix their devices and pools then; a GPU pin that comes too late is an error).
    """
    core.init()
    backend = keras.backend.backend()
    pin_local_gpu(backend)
    share = core.runtime.threads_per_rank()
    if share is None or core.local_size() == 1:
        return
    if backend == "tensorflow":
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(share)
            tf.config.threading.set_inter_op_parallelism_threads(share)
        except RuntimeError:  # TensorFlow already started: its pools are fixed
            warnings.warn(
                f"ringplug.keras.init() ran after TensorFlow's first operation, so each of "
                f"the {core.local_size()} ranks on this host keeps using all its cores "
                "(slower). Call it at the top of the script, or set OMP_NUM_THREADS.",
                stacklevel=2,
            )
    elif backend == "torch":
        import torch

        torch.set_num_threads(min(torch.get_num_threads(), share))


def scale_lr(lr: float) -> float:
    """The linear scaling rule: with N ranks the global batch is N times larger, so is the
    learning rate (warm up to it with `RingWarmup`)."""
    return lr * core.size()


def on_rank_zero(*callbacks: keras.callbacks.Callback) -> list[keras.callbacks.Callback]:
    """`callbacks` on rank 0, nothing elsewhere: for ModelCheckpoint, TensorBoard, CSVLogger
    and anything else that should write once.

    Among them, ModelCheckpoints get a callback on every rank in front of them that, with a
    sharded optimizer (``DistributedOptimizer(..., zero=1)``), gathers the whole optimizer
    state to rank 0 whenever they save (`ConsolidateForCheckpoints`): the checkpoint then
    holds it, as without sharding."""
    checkpoints = [c for c in callbacks if isinstance(c, keras.callbacks.ModelCheckpoint)]
    first = [ConsolidateForCheckpoints(checkpoints)] if checkpoints else []
    return first + (list(callbacks) if core.rank() == 0 else [])


def verbose(level: int | str = "auto") -> Any:
    """``fit(verbose=...)``: `level` on rank 0 and 0 elsewhere, so one progress bar shows."""
    return level if core.rank() == 0 else 0


__all__ = [
    "Average",
    "BackupAndRestore",
    "ConsolidateForCheckpoints",
    "DistributedOptimizer",
    "Preempted",
    "RanksDisagreeError",
    "RingBroadcast",
    "RingDiagnose",
    "RingMetricAverage",
    "RingSchedule",
    "RingWarmup",
    "ShardedPyDataset",
    "Sum",
    "WarmupSchedule",
    "broadcast_variables",
    "bucketed_dataset",
    "check_agreement",
    "consolidate",
    "init",
    "on_rank_zero",
    "scale_lr",
    "shard",
    "verbose",
]
