"""Measure what one ``hvd.elastic.KerasState.commit()`` costs, in milliseconds.

    KERAS_BACKEND=tensorflow python tests/measure_hvd_commit_keras.py [--commits 20]

One process (a world of one), SGD with momentum (so the optimizer state is as large as the
model), after one step. For Horovod's elastic Keras MNIST example's convnet (1.2 M
parameters) and an MLP with ResNet-18's parameter count (11.7 M: only the state's size
matters here, as in measure_hvd_commit.py), the median over `--commits` commits of: the
commit in memory only (no elastic job: ``save()`` copies and serialises the state) and the
commit written to disk too (``RINGPLUG_ELASTIC_DIR`` set: what rank 0 of each host does
under ``ringrun --max-restarts``). Not a test: it only prints one row per model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import ringplug.horovod.keras as hvd  # noqa: E402


def mnist_example() -> tuple[keras.Model, tuple[int, ...]]:
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            layers.Conv2D(32, 3, activation="relu"),
            layers.Conv2D(64, 3, activation="relu"),
            layers.MaxPooling2D(2),
            layers.Flatten(),
            layers.Dense(128, activation="relu"),
            layers.Dense(10, activation="softmax"),
        ]
    )
    return model, (28, 28, 1)


def resnet18_sized() -> tuple[keras.Model, tuple[int, ...]]:
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((2048,)),
            layers.Dense(2048),
            layers.Dense(2048),
            layers.Dense(1000),
            layers.Dense(1000),
            layers.Dense(250),
        ]
    )
    return model, (2048,)


def median_ms(state: hvd.elastic.KerasState, commits: int) -> float:
    times = []
    for _ in range(commits):
        start = time.perf_counter()
        state.commit()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commits", type=int, default=20)
    commits = parser.parse_args().commits
    hvd.init()
    print(f"{'model':<16}{'parameters':>12}{'commit bytes':>14}{'memory ms':>11}{'disk ms':>9}")
    for name, build in (("resnet18-sized", resnet18_sized), ("mnist example", mnist_example)):
        model, shape = build()
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
        features = np.zeros((2, *shape), "float32")
        model.fit(features, np.zeros((2, *model.output_shape[1:]), "float32"), verbose=0)
        state = hvd.elastic.KerasState(model, epoch=0, batch=0)
        os.environ.pop("RINGPLUG_ELASTIC_DIR", None)
        os.environ.pop("RINGPLUG_JOB_ID", None)
        state._store = None
        memory = median_ms(state, commits)
        with tempfile.TemporaryDirectory() as folder:
            os.environ["RINGPLUG_ELASTIC_DIR"] = folder
            state._store = None
            disk = median_ms(state, commits)
            size = sum(p.stat().st_size for p in os.scandir(folder))
        count = model.count_params()
        print(f"{name:<16}{count:>12,}{size:>14,}{memory:>11.1f}{disk:>9.1f}")


if __name__ == "__main__":
    main()
