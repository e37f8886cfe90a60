"""Horovod-style elastic Keras and TensorFlow trainings (only ``hvd.*`` names), the API calls
of Horovod's two elastic TensorFlow 2 examples on generated data:
``python hvd_elastic_keras.py fit|tape DIR``.

``fit``  (``tensorflow2_keras_mnist_elastic.py``): ``ringplug.horovod.tensorflow.keras``,
         `KerasState`, the three state callbacks (a commit every 3 batches and at each
         epoch's end), ``fit(steps_per_epoch=24 // size, epochs=3 - state.epoch)``. Rank 2 of
         the first start SIGKILLs itself at the end of batch 4 of epoch 1, one batch after
         a commit.
``tape`` (``tensorflow2_mnist_elastic.py``): ``ringplug.horovod.tensorflow``, a
         ``tf.function`` step with `DistributedGradientTape`, `TensorFlowKerasState`, a commit
         after every batch of ``dataset.skip(state.batch).take(30 // size)``. Rank 2 of the
         first start SIGKILLs itself before training batch 6.

Both: the weights differ by rank until the state's sync, the learning rate is 0.001 times
the number of ranks, and a reset callback sets it again. Every rank writes, to DIR:

  commits.<restart>.<rank>  one JSON line a commit: its number, state.epoch and state.batch,
                            the weights and the optimizer's step count
  batches.<restart>.<rank>  (fit) one JSON line a batch: state.epoch and state.batch then
  start.<restart>.<rank>    what `train` began with: the state, the weights, the step
                            count, the learning rate, the world size, the job id
  reset.<restart>.<rank>    one line each time a reset callback ran
  final.<restart>.<rank>    the final weights
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf


def weights_of(model) -> list:
    return [w.tolist() for w in model.get_weights()]


def step_count(optimizer) -> int:
    return int(optimizer.iterations.numpy())


def logged(base, folder: Path, restart: int, rank: int):
    """`base` (a Horovod state class) that also counts its commits and writes each one."""

    class Logged(base):
        def commit(self) -> None:
            self.commits += 1
            super().commit()
            line = {
                "commit": self.commits,
                "epoch": getattr(self, "epoch", None),
                "batch": self.batch,
                "weights": weights_of(self.model),
                "steps": step_count(self.optimizer),
            }
            with open(folder / f"commits.{restart}.{rank}", "a") as out:
                out.write(json.dumps(line) + "\n")

    return Logged


def dataset() -> tf.data.Dataset:
    features = np.random.default_rng(0).normal(size=(96, 6)).astype("float32")
    targets = features.sum(axis=1, keepdims=True)
    return tf.data.Dataset.from_tensor_slices((features, targets)).repeat().batch(8)


def model_for(rank: int):
    import keras

    keras.utils.set_random_seed(rank)  # different on purpose: the sync must make them equal
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    )


def write_start(folder: Path, restart: int, rank: int, state, size: int) -> None:
    start = {
        "epoch": getattr(state, "epoch", None),
        "batch": state.batch,
        "commits": state.commits,
        "weights": weights_of(state.model),
        "steps": step_count(state.optimizer),
        "size": size,
        "lr": float(state.optimizer.learning_rate.numpy()),
        "job": os.environ.get("RINGPLUG_JOB_ID"),
    }
    (folder / f"start.{restart}.{rank}").write_text(json.dumps(start))


def fit_style(folder: Path) -> None:
    import keras

    import ringplug.horovod.tensorflow.keras as hvd

    hvd.init()
    rank, restart = hvd.rank(), int(os.environ["RINGPLUG_RESTART"])
    data = dataset()
    model = model_for(rank)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(loss="mse", optimizer=opt)
    model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)  # builds the optimizer, as Horovod's

    state = logged(hvd.elastic.KerasState, folder, restart, rank)(
        model, batch=0, epoch=0, commits=0
    )

    def on_state_reset() -> None:
        state.model.optimizer.learning_rate.assign(0.001 * hvd.size())
        with open(folder / f"reset.{restart}.{rank}", "a") as out:
            out.write(f"{hvd.size()}\n")

    state.register_reset_callbacks([on_state_reset])

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if restart == 0 and rank == 2 and state.epoch == 1 and batch == 4:
                os.kill(os.getpid(), signal.SIGKILL)  # batch 4 trained, not committed

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            with open(folder / f"batches.{restart}.{rank}", "a") as out:
                out.write(json.dumps({"epoch": state.epoch, "batch": state.batch}) + "\n")

    callbacks = [
        Kill(),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=3),
        Record(),
    ]

    @hvd.elastic.run
    def train(state) -> None:
        write_start(folder, restart, rank, state, hvd.size())
        state.model.fit(
            data,
            steps_per_epoch=24 // hvd.size(),
            epochs=3 - state.epoch,
            callbacks=callbacks,
            verbose=0,
        )

    train(state)
    (folder / f"final.{restart}.{rank}").write_text(json.dumps(weights_of(model)))


def tape_style(folder: Path) -> None:
    import keras

    import ringplug.horovod.tensorflow as hvd

    hvd.init()
    rank, restart = hvd.rank(), int(os.environ["RINGPLUG_RESTART"])
    data = dataset()
    model = model_for(rank)
    loss = keras.losses.MeanSquaredError()
    lr = 0.001
    opt = keras.optimizers.Adam(lr * hvd.size())

    @tf.function
    def training_step(features, targets, allreduce=True):
        with tf.GradientTape() as tape:
            loss_value = loss(targets, model(features, training=True))
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))  # noqa: B905 - Horovod's
        return loss_value

    for features, targets in data.take(1):  # builds the optimizer, as Horovod's example
        training_step(features, targets, allreduce=False)

    @hvd.elastic.run
    def train(state) -> None:
        write_start(folder, restart, rank, state, hvd.size())
        start_batch = state.batch
        for batch_idx, (features, targets) in enumerate(
            data.skip(state.batch).take(30 // hvd.size())
        ):
            state.batch = start_batch + batch_idx
            if restart == 0 and rank == 2 and state.batch == 6:
                os.kill(os.getpid(), signal.SIGKILL)  # before its step: batch 6 never done
            training_step(features, targets)
            state.commit()

    state = logged(hvd.elastic.TensorFlowKerasState, folder, restart, rank)(
        model, opt, batch=0, commits=0
    )

    def on_state_reset() -> None:
        opt.learning_rate.assign(lr * hvd.size())
        with open(folder / f"reset.{restart}.{rank}", "a") as out:
            out.write(f"{hvd.size()}\n")

    state.register_reset_callbacks([on_state_reset])
    train(state)
    (folder / f"final.{restart}.{rank}").write_text(json.dumps(weights_of(model)))


if __name__ == "__main__":
    {"fit": fit_style, "tape": tape_style}[sys.argv[1]](Path(sys.argv[2]))
