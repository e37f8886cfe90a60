"""Multi-rank worker: RingDiagnose's verdict on Keras fits with planted bottlenecks.

``python diagnose_keras.py OUTDIR SCENARIO ...`` on the backend in KERAS_BACKEND runs each
fit in this one process and writes OUTDIR/<scenario>-<rank>.json with the diagnosis.
Planted on rank 1: a dataset that sleeps per batch ("data"), a layer that sleeps in the
forward pass ("straggler"); on every rank: a 32 MiB embedding table of which a step uses 2
rows ("communication"), a layer that sleeps ("compute": the sleep stands in for work on an
accelerator, and keeps the ranks' compute equal on a loaded machine).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import keras
import numpy as np

import ringplug
import ringplug.keras as rk

PLANTED_SLEEP_S = 0.04  # planted load, many times the step's own work
STEPS = 16


def shapes(scenario: str) -> tuple[int, int, int]:
    """(features, hidden, batch) of each scenario's model and data."""
    if scenario == "communication":
        return 1 << 16, 128, 2  # a 32 MiB table, next to nothing to compute
    return 16, 32, 8


class Sleep(keras.layers.Layer):
    """Identity, but the forward pass sleeps on the given ranks (planted compute)."""

    def __init__(self, ranks: tuple[int, ...], **kwargs) -> None:
        super().__init__(**kwargs)
        self.ranks = ranks

    def _sleep(self, value):
        if ringplug.rank() in self.ranks:
            time.sleep(PLANTED_SLEEP_S)
        return value

    def call(self, x):
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            # The same op on every rank; the gradient flows around it, through x.
            slept = tf.numpy_function(self._sleep, [tf.reduce_sum(x)], x.dtype, stateful=True)
            slept.set_shape([])
            return x + 0.0 * tf.stop_gradient(slept)
        self._sleep(None)
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


class Batches(keras.utils.PyDataset):
    """This rank's batches; on rank 1 of the "data" scenario each takes a while to load."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, slow: bool) -> None:
        super().__init__()
        self.x, self.y, self.batch, self.slow = x, y, batch, slow

    def __len__(self) -> int:
        return len(self.x) // self.batch

    def __getitem__(self, index: int):
        if self.slow:
            time.sleep(PLANTED_SLEEP_S)
        rows = slice(index * self.batch, (index + 1) * self.batch)
        return self.x[rows], self.y[rows]


def make_model(scenario: str) -> keras.Model:
    features, hidden, _ = shapes(scenario)
    if scenario == "communication":
        layers = [
            keras.Input((1,), dtype="int32"),
            keras.layers.Embedding(features, hidden),
            keras.layers.Flatten(),
        ]
    else:
        layers = [keras.Input((features,)), keras.layers.Dense(hidden, activation="tanh")]
    if scenario in ("straggler", "compute"):
        layers.append(Sleep((1,) if scenario == "straggler" else (0, 1)))
    model = keras.Sequential([*layers, keras.layers.Dense(1)])
    model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(1e-4)), loss="mse")
    return model


def fit(scenario: str, outdir: Path) -> dict:
    features, _, batch = shapes(scenario)
    rng = np.random.default_rng(ringplug.rank())
    rows = batch * (STEPS + 1)
    if scenario == "communication":
        x = rng.integers(0, features, (rows, 1)).astype("int32")
    else:
        x = rng.normal(size=(rows, features)).astype("float32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    data = Batches(x, y, batch, slow=scenario == "data" and ringplug.rank() == 1)
    diagnose = rk.RingDiagnose()
    csv = outdir / f"{scenario}-{ringplug.rank()}.csv"
    callbacks = [rk.RingBroadcast(0), diagnose, keras.callbacks.CSVLogger(str(csv))]
    make_model(scenario).fit(data, epochs=1, callbacks=callbacks, verbose=0)
    return {**diagnose.diagnosis.as_dict(), "table": diagnose.diagnosis.table()}


def main() -> None:
    rk.init()
    outdir = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        report = fit(scenario, outdir)
        path = outdir / f"{scenario}-{ringplug.rank()}.json"
        path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
