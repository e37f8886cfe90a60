"""Measure Keras ``DistributedOptimizer(zero=1)`` against ``zero=0``: step time and optimizer
state per rank, on an MLP of LAYERS Dense layers of WIDTH units, with Adam.

    KERAS_BACKEND=torch ringrun -np 2 python tests/measure_keras_zero.py [--width 1024]
        [--layers 8] [--steps 30] [--rounds 2]

Each round fits zero=0 then zero=1 (the same model and data), one epoch of `steps` batches
after one warm-up batch (tracing, building); the step time is the median of the timed
batches' (``on_train_batch_end`` to the next, rank 0). Rank 0 prints one row per run and the
ratio. Not a test: it only prints.
"""

from __future__ import annotations

import argparse
import statistics
import time

import keras
import numpy as np

import ringplug
import ringplug.keras as rk


class Clock(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[float] = []

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.stamps.append(time.perf_counter())


def state_bytes(optimizer) -> int:
    scalars = {id(optimizer._iterations), id(getattr(optimizer, "_learning_rate", None))}
    return sum(
        int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in optimizer.variables
        if id(v) not in scalars
    )


def run(zero: int, width: int, layers: int, steps: int, batch: int) -> tuple[float, int]:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
    )
    optimizer = rk.DistributedOptimizer(keras.optimizers.Adam(1e-4), zero=zero)
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(ringplug.rank())
    x = rng.normal(size=((steps + 1) * batch, width)).astype("float32")
    clock = Clock()
    model.fit(x, x, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[rk.RingBroadcast(0, check_agreement=None), clock])  # fmt: skip
    gaps = np.diff(clock.stamps)  # the first batch (tracing) is not a gap
    return statistics.median(gaps) * 1e3, state_bytes(model.optimizer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rk.init()
    params = args.layers * (args.width * args.width + args.width)
    rows = []
    for _ in range(args.rounds):
        for zero in (0, 1):
            ms, mine = run(zero, args.width, args.layers, args.steps, args.batch)
            everyone = ringplug.allgather_object(mine)
            rows.append((zero, ms, everyone))
    if ringplug.rank() == 0:
        print(f"# {keras.backend.backend()}, {ringplug.size()} ranks, {params / 1e6:.1f} M "
              f"parameters, Adam, batch {args.batch} per rank")  # fmt: skip
        print(f"{'zero':>4} {'step ms':>9} {'state MB per rank':>30}")
        for zero, ms, everyone in rows:
            sizes = " ".join(f"{b / 1e6:.1f}" for b in everyone)
            print(f"{zero:>4} {ms:>9.1f} {sizes:>30}")
        for zero in (0, 1):
            times = [ms for z, ms, _ in rows if z == zero]
            print(f"zero={zero}: median of rounds {statistics.median(times):.1f} ms")


if __name__ == "__main__":
    main()
