"""ringplug for Keras 3 (TensorFlow, torch and JAX backends).

``import ringplug.keras`` imports Keras; ``import ringplug`` alone never does. A training
script needs four additions::

    import ringplug.keras as rk

    rk.init()                                     # MPI, and this rank's share of the cores
    model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(rk.scale_lr(0.01))),
                  loss="sparse_categorical_crossentropy")
    model.fit(rk.shard(dataset).shuffle(1000).batch(32), epochs=10,
              callbacks=[rk.RingMetricAverage(), rk.RingBroadcast(0), rk.RingWarmup(3),
                         *rk.on_rank_zero(keras.callbacks.ModelCheckpoint("best.keras"))],
              verbose=rk.verbose())
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from .. import core
from ..core.ops import Average, Sum
from .callbacks import (
    RingBroadcast,
    RingMetricAverage,
    RingWarmup,
    WarmupSchedule,
    broadcast_variables,
)
from .data import ShardedPyDataset, bucketed_dataset, shard
from .diagnostics import RingDiagnose
from .optimizer import DistributedOptimizer


def init() -> None:
    """Start ringplug (MPI) and give this rank its share of the host's cores: TensorFlow's
    and torch's thread pools get cores // ranks-on-this-host threads unless
    ``OMP_NUM_THREADS`` is set. Call it at the top of the script, before the first
    TensorFlow op (TensorFlow fixes its pools then)."""
    core.init()
    share = core.runtime.threads_per_rank()
    if share is None or core.local_size() == 1:
        return
    backend = keras.backend.backend()
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
    and anything else that should write once."""
    return list(callbacks) if core.rank() == 0 else []


def verbose(level: int | str = "auto") -> Any:
    """``fit(verbose=...)``: `level` on rank 0 and 0 elsewhere, so one progress bar shows."""
    return level if core.rank() == 0 else 0


__all__ = [
    "Average", "DistributedOptimizer", "RingBroadcast", "RingDiagnose", "RingMetricAverage",
    "RingWarmup",
    "ShardedPyDataset", "Sum", "WarmupSchedule", "broadcast_variables", "bucketed_dataset",
    "init",
    "on_rank_zero", "scale_lr", "shard", "verbose",
]  # fmt: skip
