"""One training job of `ringplug-bench keras` (run by it, not by hand).

``python keras_job.py IMPL STEPS HIDDEN OUT`` trains an MLP on synthetic data with the
TensorFlow backend and IMPL = ringplug (DistributedOptimizer + RingBroadcast, ranks from
the launcher), mwms (tf.distribute.MultiWorkerMirroredStrategy with ring collectives; this
process is the worker TF_CONFIG names) or plain (one process, plain Keras). Rank 0 writes
the throughput measured after warm-up to OUT as JSON. Every job uses one intra-op and two
inter-op TensorFlow threads per rank (MWMS runs its collectives on the inter-op pool).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import keras  # noqa: E402

BATCH = 32
WARMUP = 3


class Clock(keras.callbacks.Callback):
    """Times the steps after warm-up."""

    def __init__(self) -> None:
        super().__init__()
        self.start = self.end = 0.0
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.steps += 1
        if self.steps == WARMUP:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def build(hidden: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((1024,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def main(impl: str, steps: int, hidden: int, out: str) -> None:
    callbacks: list[keras.callbacks.Callback] = []
    world, rank = 1, 0
    if impl == "ringplug":
        import ringplug
        import ringplug.keras as rk

        rk.init()
        world, rank = ringplug.size(), ringplug.rank()
        model = build(hidden)
        optimizer = rk.DistributedOptimizer(keras.optimizers.SGD(0.01))
        callbacks.append(rk.RingBroadcast(0))
    elif impl == "mwms":
        return _mwms(steps, hidden, out)
    else:
        model = build(hidden)
        optimizer = keras.optimizers.SGD(0.01)
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = _data(rank, BATCH * steps)
    clock = Clock()
    model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[clock, *callbacks]
    )
    if rank == 0:
        _write(out, impl, world, clock.steps - WARMUP, clock.end - clock.start, model)


def _data(seed: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 1024)).astype("float32"), rng.integers(0, 10, rows)


def _write(out: str, impl: str, world: int, timed: int, seconds: float, model: keras.Model) -> None:
    record = {
        "impl": impl,
        "ranks": world,
        "steps_timed": timed,
        "seconds": seconds,
        "samples_per_s": timed * BATCH * world / seconds,
        "parameters": int(model.count_params()),
    }
    with open(out, "w") as handle:
        json.dump(record, handle)


def _mwms(steps: int, hidden: int, out: str) -> None:
    """MWMS with ring collectives, in TensorFlow's own custom-loop form: Keras 3's
    ``fit`` fails under MultiWorkerMirroredStrategy (keras-team/keras#20585)."""
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    world = strategy.num_replicas_in_sync
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with strategy.scope():
        model = build(hidden)
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    losses = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x, y = _data(rank, BATCH * steps)  # this worker's own samples, per-worker batches
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    batches = iter(strategy.distribute_datasets_from_function(lambda _: data))

    @tf.function
    def train_step(iterator) -> None:
        def replica_step(inputs, labels) -> None:
            with tf.GradientTape() as tape:
                per_sample = losses(labels, model(inputs, training=True))
                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=BATCH * world)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        strategy.run(replica_step, args=next(iterator))

    start = end = 0.0
    for step in range(steps):
        train_step(batches)
        if step + 1 == WARMUP:
            start = time.perf_counter()
        end = time.perf_counter()
    if rank == 0:
        _write(out, "mwms", world, steps - WARMUP, end - start, model)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
