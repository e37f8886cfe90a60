"""A Keras training script as Horovod users write them, using only ``hvd.*`` names and
Horovod's callbacks, on Keras 3. ``python hvd_keras.py OUTDIR`` writes
OUTDIR/keras-<rank>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import ringplug.horovod.tensorflow.keras as hvd  # noqa: E402


class LearningRates(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self.seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def main(outdir: Path) -> None:
    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different weights per rank: broadcast fixes it
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x.sum(1) > 0).astype("int64")
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    scaled_lr = 0.05 * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9))
    model.compile(
        optimizer=optimizer,
        metrics=["accuracy"],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rates = LearningRates()
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2),
        # From epoch 2 on: 0.1 ** (epoch - 2), Horovod's exponential decay for a number.
        hvd.callbacks.LearningRateScheduleCallback(
            initial_lr=scaled_lr, multiplier=0.1, start_epoch=2
        ),
        rates,
    ]
    history = model.fit(
        x, y, batch_size=8, epochs=4, callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0
    )
    flat = np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])
    everyone = hvd.allgather(flat[None, :])
    report = {
        "ranks_identical": bool(
            all(np.array_equal(row, everyone[0]) for row in np.asarray(everyone))
        ),
        "loss": history.history["loss"],
        "rates": rates.seen,
        "scaled_lr": scaled_lr,
        "logged_lr": history.history["lr"],
    }
    # From Horovod's test_tensorflow2_keras.py, on Keras 3 names: a DistributedOptimizer's
    # config round-trips, and an Embedding trains with sparse_as_dense.
    adam = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    config = adam.get_config()
    report["config_round_trip"] = (
        type(adam).from_config(config).get_config() == config
        and adam.from_config(config).get_config() == config
    )
    keras.utils.set_random_seed(hvd.rank())
    embedder = keras.Sequential(
        [keras.Input((10,), dtype="int32"), keras.layers.Embedding(1000, 8)]
    )
    rmsprop = hvd.DistributedOptimizer(keras.optimizers.RMSprop(0.001), sparse_as_dense=True)
    embedder.compile(optimizer=rmsprop, loss="mse")
    tokens = rng.integers(1000, size=(32, 10))
    embedder.fit(
        tokens,
        rng.random((32, 10, 8)),
        batch_size=32,
        epochs=1,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    table = np.asarray(embedder.weights[0])
    tables = np.asarray(hvd.allgather(table[None]))
    report["sparse_as_dense_identical"] = bool(all(np.array_equal(t, tables[0]) for t in tables))
    # The collectives on backend tensors, inside a tf.function too (a custom train step),
    # integers averaged as Horovod does (truncated toward zero).
    import tensorflow as tf

    @tf.function
    def step(value: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return hvd.allreduce(value, op=hvd.Sum), hvd.broadcast(value + 1.0, root_rank=1)

    summed, broadcast = step(tf.constant([float(hvd.rank())]))
    report["in_tf_function"] = [float(summed[0]), float(broadcast[0])]
    integers = hvd.allreduce(np.array([-3 - hvd.rank(), 7], np.int32))
    report["integer_average"] = np.asarray(integers).tolist()
    (outdir / f"keras-{hvd.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
