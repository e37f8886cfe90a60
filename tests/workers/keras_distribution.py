"""`KERAS_BACKEND=jax python keras_distribution.py`: ringplug's optimizer and a
``keras.distribution`` at once are refused, whichever comes first; prints one JSON line."""

from __future__ import annotations

import json

import keras
import numpy as np

import ringplug.keras as rk


def error_of(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return ""


def fit(optimizer) -> None:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(
        np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=4, epochs=1, verbose=0
    )


rk.init()
report = {"plain_fit": error_of(lambda: fit(rk.DistributedOptimizer(keras.optimizers.SGD())))}
keras.distribution.set_distribution(keras.distribution.DataParallel())
report["made_under_distribution"] = error_of(
    lambda: rk.DistributedOptimizer(keras.optimizers.SGD())
)
keras.distribution.set_distribution(None)
optimizer = rk.DistributedOptimizer(keras.optimizers.SGD())
keras.distribution.set_distribution(keras.distribution.DataParallel())  # set afterwards
report["fit_under_distribution"] = error_of(lambda: fit(optimizer))
keras.distribution.set_distribution(None)
print(json.dumps(report), flush=True)
