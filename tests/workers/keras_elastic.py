"""Multi-rank worker: a Keras fit under ringrun that stops midway and resumes mid-epoch.

``python keras_elastic.py SCENARIO DIR RUNS MARKER`` (``KERAS_BACKEND`` picks the backend):
RUNS is how many times the test started the job before (the start is RUNS +
RINGPLUG_RESTART); MARKER names the processes.

  kill     72 samples in a ``ringplug.keras.bucketed_dataset`` (batches of 4), 3 epochs,
           Keras's own ``keras.callbacks.BackupAndRestore(save_freq=2)`` beside
           ``RingBroadcast``. In the first start (RINGPLUG_RESTART=0) rank 2 SIGKILLs itself
           before step 10 (after writing DIR/kill.json with the time); ringrun restarts the
           job, whose fit restores the backup.
  sigterm  96 samples, 1 epoch, ``ringplug.keras.BackupAndRestore`` (no periodic backup).
           In the first start every rank writes DIR/running.<rank> after step 3 and waits
           (bounded) for SIGTERM, which makes every rank stop after the same batch and rank 0
           save; a second start resumes from that backup.

Every rank appends each trained batch to DIR/ledger.<start>.<rank>.jsonl: the sample ids the
train step saw (recorded inside the model's forward pass), the step (optimizer iterations)
and weights after it, the epoch and Keras's batch index. It writes DIR/done.<start>.<rank>.json
at the end of a fit (steps, weights, the world, the step and weights it started from).
Rank 0 of a restart writes DIR/times.<start>.json: when the script started, when Keras and
ringplug were imported, when the backup was restored and when the first step ended.
"""

from __future__ import annotations

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import ringplug  # noqa: E402
import ringplug.keras as rk  # noqa: E402

IMPORTED = time.time()
BATCH = 4
KILL_BEFORE_STEP = 10  # rank 2 of the first start dies with 9 steps done; the backup is of 8
SEEN: list[list[int]] = []  # the ids of each forward pass in training, in order


def record(ids: np.ndarray) -> np.ndarray:
    SEEN.append(np.asarray(ids).reshape(-1).tolist())
    return np.zeros((len(ids), 1), np.float32)


class Recorder(keras.layers.Layer):
    """Zeros of shape (batch, 1) that record the batch's sample ids while training."""

    def call(self, ids, training=None):
        if not training:
            return keras.ops.zeros((keras.ops.shape(ids)[0], 1))
        backend = keras.backend.backend()
        if backend == "tensorflow":
            import tensorflow as tf

            out = tf.numpy_function(record, [ids], tf.float32, stateful=True)
            out.set_shape((None, 1))
            return out
        if backend == "jax":
            import jax
            from jax.experimental import io_callback

            shape = jax.ShapeDtypeStruct((ids.shape[0], 1), np.float32)
            return io_callback(record, shape, ids, ordered=True)
        zeros = record(keras.ops.convert_to_numpy(ids))
        return keras.ops.convert_to_tensor(zeros)


def make_model() -> keras.Model:
    x = keras.Input((4,), name="x")
    ids = keras.Input((), dtype="int64", name="id")
    out = keras.layers.Dense(1, name="dense")(x) + Recorder()(ids)
    model = keras.Model({"x": x, "id": ids}, out)
    optimizer = rk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def dataset(count: int):
    import tensorflow as tf

    rng = np.random.default_rng(5)
    x = rng.normal(size=(count, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)).astype(np.float32)
    lengths = [1 + (i * 7) % 13 for i in range(count)]

    def collate(samples: list[tuple]) -> tuple:
        features = {
            "x": np.stack([s[0] for s in samples]),
            "id": np.array([s[2] for s in samples], np.int64),
        }
        return features, np.stack([s[1] for s in samples])

    signature = (
        {"x": tf.TensorSpec((None, 4), tf.float32), "id": tf.TensorSpec((None,), tf.int64)},
        tf.TensorSpec((None, 1), tf.float32),
    )
    return rk.bucketed_dataset(
        lambda i: (x[i], y[i], i), lengths, signature, batch_size=BATCH, collate=collate, seed=3
    )


def weights(model: keras.Model) -> list[float]:
    return np.concatenate(
        [keras.ops.convert_to_numpy(w).reshape(-1) for w in model.trainable_weights]
    ).tolist()


def steps(model: keras.Model) -> int:
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


class Ledger(keras.callbacks.Callback):
    """Writes each trained batch; kills rank 2 of the first start; times the restart.

    First in the callbacks: a batch that BackupAndRestore ends with `Preempted` is written.
    """

    def __init__(self, folder: Path, start: int, kill: bool) -> None:
        super().__init__()
        self.folder, self.start, self.kill = folder, start, kill
        self.rank = ringplug.rank()
        self.file = open(folder / f"ledger.{start}.{self.rank}.jsonl", "a")  # noqa: SIM115
        self.times = {"script": STARTED, "imported": IMPORTED}
        self.began: dict | None = None
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if self.began is None:  # the backup is restored by now: what the fit starts from
            self.times["restored"] = time.time()
            self.began = {"step": steps(self.model), "weights": weights(self.model)}
        victim = self.kill and self.start == 0 and self.rank == 2
        if victim and steps(self.model) == KILL_BEFORE_STEP - 1:
            (self.folder / "kill.json").write_text(json.dumps({"time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None) -> None:
        seen = [i for forward in SEEN for i in forward]
        SEEN.clear()
        entry = {
            "step": steps(self.model),
            "epoch": self.epoch,
            "batch": batch,
            "ids": seen,
            "weights": weights(self.model),
        }
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()
        if "first_step" not in self.times:
            self.times["first_step"] = time.time()
            if self.start > 0 and self.rank == 0:
                (self.folder / f"times.{self.start}.json").write_text(json.dumps(self.times))


class WaitForSigterm(keras.callbacks.Callback):
    """After step 3 of the first start: say so, then wait (bounded) for ringrun's SIGTERM."""

    def __init__(self, folder: Path, received: threading.Event) -> None:
        super().__init__()
        self.folder, self.received = folder, received

    def on_train_batch_end(self, batch, logs=None) -> None:
        if steps(self.model) == 3:
            (self.folder / f"running.{ringplug.rank()}").write_text("")
            if not self.received.wait(60):
                raise RuntimeError("no SIGTERM came within 60 s")


def main(scenario: str, folder: Path, runs: int) -> None:
    rk.init()
    start = runs + int(os.environ.get("RINGPLUG_RESTART", "0"))
    rank, size = ringplug.rank(), ringplug.size()
    keras.utils.set_random_seed(100 + rank)  # other weights on every rank until the broadcast
    model = make_model()
    ledger = Ledger(folder, start, kill=scenario == "kill")
    backup_dir = str(folder / "backup")
    if scenario == "kill":
        data, epochs = dataset(72), 3
        callbacks = [
            ledger,
            rk.RingBroadcast(0),
            keras.callbacks.BackupAndRestore(backup_dir, save_freq=2),
        ]
    else:
        data, epochs = dataset(96), 1
        callbacks = [ledger, rk.RingBroadcast(0), rk.BackupAndRestore(backup_dir, save_freq=1000)]
        if start == 0:
            received = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: received.set())
            callbacks.append(WaitForSigterm(folder, received))
    model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks)
    report = {
        "steps": steps(model),
        "weights": weights(model),
        "world": size,
        "began": ledger.began,
        "backup_left": os.path.exists(backup_dir),
    }
    (folder / f"done.{start}.{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
