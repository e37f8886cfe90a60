"""Multi-rank worker: ringplug.keras on the backend in KERAS_BACKEND.

``python keras_fit.py OUTDIR [SCENARIO ...]`` runs each scenario in this one process (to
pay for importing the framework once) and writes OUTDIR/keras-<rank>.json with a dict of
findings per scenario. Each training scenario also trains a plain Keras reference, in this
process, on the union of the ranks' batches, and compares.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import keras
import numpy as np

import ringplug
import ringplug.keras as rk

B, STEPS, FEATURES = 4, 6, 5


def data(size: int, salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7 + salt)
    rows = B * size * STEPS
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 2)) + 0.1).astype("float32")
    return x, y


def make_model(seed: int, dtype_policy: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh", dtype=dtype_policy),
            keras.layers.Dense(2, dtype="float32"),
        ]
    )


def my_rows(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rank r's samples, so that each step's union over ranks is one contiguous block of
    B * size rows: batch k of rank r holds rows k*B*size + r*B ... + B."""
    rank, size = ringplug.rank(), ringplug.size()
    index = np.concatenate(
        [
            np.arange(k * B * size + rank * B, k * B * size + (rank + 1) * B)
            for k in range(len(x) // (B * size))
        ]
    )
    return x[index], y[index]


def flat_weights(model: keras.Model) -> np.ndarray:
    return np.concatenate(
        [np.asarray(keras.ops.convert_to_numpy(w), np.float64).ravel() for w in model.weights]
    )


def identical_everywhere(values: np.ndarray) -> bool:
    everyone = ringplug.allgather(values[None, :])
    return bool(all(np.array_equal(row, everyone[0]) for row in everyone))


def train_and_compare(
    optimizer_kwargs: dict,
    accumulate: int = 1,
    per_execution: int = 1,
    epochs: int = 2,
    jit_compile: bool | str = "auto",
) -> dict:
    """2 ranks x batch B with ringplug against 1 process x batch B*size on the union."""
    size = ringplug.size()
    x, y = data(size)
    root_initial = flat_weights(make_model(seed=100))  # rank 0's
    model = make_model(seed=100 + ringplug.rank())  # different on every rank: broadcast
    optimizer = rk.DistributedOptimizer(
        keras.optimizers.SGD(**optimizer_kwargs), backward_passes_per_step=accumulate
    )
    model.compile(
        optimizer=optimizer, loss="mse", steps_per_execution=per_execution, jit_compile=jit_compile
    )
    engine = ringplug.core.runtime.engine()
    before = engine.collectives_run
    mx, my = my_rows(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            mx,
            my,
            batch_size=B,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[rk.RingBroadcast(0)],
        )
    collectives = engine.collectives_run - before

    reference = make_model(seed=100)
    extra = {"gradient_accumulation_steps": accumulate} if accumulate > 1 else {}
    reference.compile(
        optimizer=keras.optimizers.SGD(**optimizer_kwargs, **extra),
        loss="mse",
        steps_per_execution=per_execution,
    )
    reference.fit(x, y, batch_size=B * size, epochs=epochs, shuffle=False, verbose=0)
    mine, expected = flat_weights(model), flat_weights(reference)
    return {
        "matches_one_process": bool(np.allclose(mine, expected, atol=1e-5, rtol=0)),
        "max_difference": float(np.abs(mine - expected).max()),
        "ranks_identical": identical_everywhere(mine),
        "moved_from_start": bool(np.abs(mine - root_initial).max() > 1e-3),
        "collectives": collectives,
        "optimizer_steps": int(keras.ops.convert_to_numpy(optimizer.iterations)),
        "warnings": [str(w.message) for w in caught if "ringplug" in str(w.message)],
    }


def scenario_mixed() -> dict:
    """mixed_float16 with one rank's gradients infinite at one step: no hang, no drift."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        size = ringplug.size()
        x, y = data(size, salt=1)
        mx, my = my_rows(x, y)
        if ringplug.rank() == 1:
            mx = mx.copy()
            mx[B * 2] = 6e4  # overflows float16 in the first layer: inf gradients here only
        model = make_model(seed=100 + ringplug.rank())
        model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
        model.fit(
            mx,
            my,
            batch_size=B,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[rk.RingBroadcast(0)],
        )
        optimizer = model.optimizer
        scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
        weights = flat_weights(model)
        return {
            "loss_scale_optimizer": type(optimizer).__name__,
            "ranks_identical": identical_everywhere(weights),
            "finite": bool(np.isfinite(weights).all()),
            # The skipped step halved the scale on both ranks alike.
            "scales": ringplug.allgather_object(scale),
        }
    finally:
        keras.mixed_precision.set_global_policy("float32")


class Recorder(keras.callbacks.Callback):
    """Records the LR and SGD's momentum slots at each batch start."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []
        self.slots: list[float] = []

    def on_train_batch_begin(self, batch, logs=None) -> None:
        optimizer = self.model.optimizer
        self.lrs.append(float(keras.ops.convert_to_numpy(optimizer.learning_rate)))
        momentums = getattr(optimizer, "momentums", None) or []
        self.slots.append(
            float(sum(np.abs(keras.ops.convert_to_numpy(m)).sum() for m in momentums))
        )


def scenario_warmup() -> dict:
    size = ringplug.size()
    x, y = data(size)
    mx, my = my_rows(x, y)
    model = make_model(seed=0)
    model.compile(
        optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.2, momentum=0.9)), loss="mse"
    )
    before, after = Recorder(), Recorder()
    callbacks = [rk.RingBroadcast(0), before, rk.RingWarmup(warmup_epochs=2), after]
    model.fit(
        mx,
        my,
        batch_size=B,
        epochs=3,
        initial_epoch=1,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return {
        "lrs": after.lrs,
        "slots_before": before.slots,
        "slots_after": after.slots,
        "lrs_before": before.lrs,
        "steps_per_epoch": STEPS,
    }


def scenario_warmup_resume(outdir: Path) -> dict:
    """Warm up over 3 epochs, save after epoch 1 (mid-warmup), resume with
    fit(initial_epoch=1). Only rank 0 loads the checkpoint; rank 1 builds a fresh model
    with another LR, and RingWarmup comes before RingBroadcast: the warmup must still go
    on towards the original target on both ranks."""
    size = ringplug.size()
    x, y = data(size)
    mx, my = my_rows(x, y)
    path = outdir / "warmup-resume.keras"
    model = make_model(seed=0)
    model.compile(
        optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.3, momentum=0.9)), loss="mse"
    )
    model.fit(
        mx,
        my,
        batch_size=B,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[rk.RingBroadcast(0), rk.RingWarmup(warmup_epochs=3)],
    )
    if ringplug.rank() == 0:
        model.save(path)
    ringplug.barrier()
    if ringplug.rank() == 0:
        model = keras.saving.load_model(path)
        rk.DistributedOptimizer(model.optimizer)
    else:
        model = make_model(seed=5)
        model.compile(
            optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.7, momentum=0.9)), loss="mse"
        )
    seen = Recorder()
    model.fit(
        mx,
        my,
        batch_size=B,
        epochs=3,
        initial_epoch=1,
        shuffle=False,
        verbose=0,
        callbacks=[rk.RingWarmup(warmup_epochs=3), rk.RingBroadcast(0), seen],
    )
    return {
        "lrs": seen.lrs,
        "steps_per_epoch": STEPS,
        "ranks_identical": identical_everywhere(flat_weights(model)),
    }


class Perturb(keras.callbacks.Callback):
    """Rank 1's own val_loss rises from epoch 1 on, rank 0's falls: alone, they would stop at
    different epochs."""

    def on_epoch_end(self, epoch, logs=None) -> None:
        logs["val_loss"] = 1.0 - 0.1 * epoch if ringplug.rank() == 0 else 1.0 + 0.5 * epoch


def scenario_early_stopping(outdir: Path) -> dict:
    size = ringplug.size()
    x, y = data(size)
    mx, my = my_rows(x, y)
    model = make_model(seed=0)
    model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1)
    checkpoints = outdir / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    name = f"epoch{{epoch}}-rank{ringplug.rank()}.weights.h5"
    saver = keras.callbacks.ModelCheckpoint(str(checkpoints / name), save_weights_only=True)
    history = model.fit(
        mx,
        my,
        batch_size=B,
        epochs=8,
        shuffle=False,
        verbose=0,
        callbacks=[
            Perturb(),
            rk.RingMetricAverage(),
            rk.RingBroadcast(0),
            stopper,
            *rk.on_rank_zero(saver),
        ],
    )
    return {"epochs_run": len(history.history["loss"]), "val_loss": history.history["val_loss"]}


def scenario_save_load(outdir: Path) -> dict:
    model = make_model(seed=0)
    model.compile(
        optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5)), loss="mse"
    )
    x, y = my_rows(*data(ringplug.size()))
    model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[rk.RingBroadcast(0)])
    path = outdir / f"model-{ringplug.rank()}.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    return {
        "class": f"{type(loaded.optimizer).__module__}.{type(loaded.optimizer).__name__}",
        "plain": not hasattr(loaded.optimizer, "_ringplug"),
        "same_weights": bool(np.array_equal(flat_weights(loaded), flat_weights(model))),
        "momentum": float(loaded.optimizer.momentum),
    }


def scenario_late_build() -> dict:
    """A model without an Input builds on its first batch; it is broadcast right after."""
    keras.utils.set_random_seed(100 + ringplug.rank())
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(2)])
    model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = my_rows(*data(ringplug.size()))
    model.fit(x[:B], y[:B], batch_size=B, epochs=1, verbose=0, callbacks=[rk.RingBroadcast(0)])
    return {"ranks_identical": identical_everywhere(flat_weights(model))}


def scenario_undistributed() -> dict:
    """A plain optimizer under RingBroadcast: warned, not silently drifting."""
    model = make_model(seed=0)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = my_rows(*data(ringplug.size()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[rk.RingBroadcast(0)])
    return {"warnings": [str(w.message) for w in caught if "ringplug" in str(w.message)]}


def scenario_drift() -> dict:
    """A rank-dependent weight decay (a Python float, not broadcast) moves the ranks apart:
    RingBroadcast's check raises on every rank, at the epoch's end or every N batches."""
    found = {}
    for every in ("epoch", 2):
        model = make_model(seed=0)
        decay = 0.01 * (ringplug.rank() + 1)
        optimizer = keras.optimizers.SGD(0.1, weight_decay=decay)
        model.compile(optimizer=rk.DistributedOptimizer(optimizer), loss="mse")
        x, y = my_rows(*data(ringplug.size()))
        try:
            model.fit(
                x,
                y,
                batch_size=B,
                epochs=2,
                verbose=0,
                callbacks=[rk.RingBroadcast(0, check_agreement=every)],
            )
            found[str(every)] = {"raised": False}
        except rk.RanksDisagreeError as error:
            found[str(every)] = {
                "raised": True,
                "tensor": error.tensor,
                "groups": error.groups,
                "message": str(error),
            }
    return found


def scenario_bucketed() -> dict:
    """bucketed_dataset on 101 skewed-length samples: aligned, equal batch counts, fit."""
    import tensorflow as tf

    lengths = [1 + (i * 7919 % 97) ** 2 // 40 for i in range(101)]

    def load(i: int) -> tuple:
        return (
            np.full((2, lengths[i]), i, np.float32),
            np.full(1 + i % 5, i % 10 + 1, np.int64),
            i,
        )

    signature = (
        tf.TensorSpec((None, 2, None), tf.float32),
        tf.TensorSpec((None,), tf.int64),
        tf.TensorSpec((None, None), tf.int64),
        tf.TensorSpec((None,), tf.int64),
        tf.TensorSpec((None,), tf.int64),
    )
    dataset = rk.bucketed_dataset(load, lengths, signature, max_tokens=2000, seed=2)
    epochs, aligned = [], True
    for _ in range(2):
        ids, batches = [], 0
        for inputs, widths, targets, target_lengths, batch_ids in dataset:
            batches += 1
            for row, i in enumerate(batch_ids.numpy().tolist()):
                ids.append(i)
                aligned &= int(widths[row]) == lengths[i]
                aligned &= bool((inputs[row, :, : lengths[i]].numpy() == i).all())
                aligned &= targets[row, : int(target_lengths[row])].numpy().tolist() == [
                    i % 10 + 1
                ] * (1 + i % 5)
        epochs.append({"ids": ids, "batches": batches})
    # Training on it: one reduction per batch, so unequal counts would hang here.
    features = dataset.map(
        lambda x, w, t, tl, i: (
            tf.reduce_mean(x, axis=[1, 2])[:, None],
            tf.cast(tl, tf.float32)[:, None],
        )
    )
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(1e-4)), loss="mse")
    history = model.fit(features, epochs=2, verbose=0, callbacks=[rk.RingBroadcast(0)])
    return {
        "epochs": epochs,
        "aligned": bool(aligned),
        "fit_epochs": len(history.history["loss"]),
        "identical": identical_everywhere(flat_weights(model)),
    }


def scenario_statistics() -> dict:
    """BatchNormalization's moving statistics follow each rank's batches; RingBroadcast
    hands root's to every rank at the end (and before validation), unless told not to."""
    found = {}
    for sync in (True, False):
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(6),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(2),
            ]
        )
        model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
        x, y = my_rows(*data(ringplug.size()))
        model.fit(
            x,
            y,
            batch_size=B,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[rk.RingBroadcast(0, sync_statistics=sync)],
        )
        statistics = np.concatenate(
            [
                np.asarray(keras.ops.convert_to_numpy(w), np.float64).ravel()
                for w in model.non_trainable_weights
            ]
        )
        found["synced" if sync else "unsynced"] = identical_everywhere(statistics)
    return found


def main(outdir: Path, scenarios: list[str]) -> None:
    rk.init()
    report = {"backend": keras.backend.backend()}
    runs = {
        "plain": lambda: train_and_compare({"learning_rate": 0.1}),
        "clipnorm": lambda: train_and_compare({"learning_rate": 0.1, "global_clipnorm": 0.05}),
        "accumulate": lambda: train_and_compare({"learning_rate": 0.1}, accumulate=2),
        "steps_per_execution": lambda: train_and_compare({"learning_rate": 0.1}, per_execution=3),
        "xla": lambda: train_and_compare({"learning_rate": 0.1}, jit_compile=True),
        "mixed": scenario_mixed,
        "warmup": scenario_warmup,
        "warmup_resume": lambda: scenario_warmup_resume(outdir),
        "early_stopping": lambda: scenario_early_stopping(outdir),
        "save_load": lambda: scenario_save_load(outdir),
        "late_build": scenario_late_build,
        "bucketed": scenario_bucketed,
        "statistics": scenario_statistics,
        "undistributed": scenario_undistributed,
        "drift": scenario_drift,
    }
    for name in scenarios or list(runs):
        report[name] = runs[name]()
    (outdir / f"keras-{ringplug.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
