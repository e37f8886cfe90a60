"""Multi-rank worker: ``DistributedOptimizer(..., zero=1)`` on the backend in KERAS_BACKEND.

``python keras_zero.py OUTDIR SCENARIO ...`` runs the scenarios in this one process and
writes OUTDIR/zero-<rank>.json. Each training compares the sharded run (zero=1) with the
unsharded one (zero=0) on the same ranks, data and initial weights.

- ``equal``: SGD with momentum, Adam, AdamW, each plain and with global_clipnorm and
  gradient accumulation together; SGD with clipnorm, Adam with EMA: 20 optimizer steps,
  weights and optimizer-state sizes.
- ``empty``: a model with fewer variables than ranks.
- ``backup_write``: a fit whose BackupAndRestore backup (kept) the ``backup_read`` scenario
  of another job restores, with this run's final weights and whole optimizer state.
- ``backup_read``: restore that backup on this job's ranks, sharded and not, and go on.
- ``save_load``: consolidate, model.save on rank 0, keras.models.load_model there.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import keras
import numpy as np

import ringplug
import ringplug.keras as rk

B, STEPS, WIDTH, LAYERS = 4, 10, 16, 6  # 10 batches an epoch, 2 epochs: 20 steps


def data(salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rank r's rows: other rows on every rank, so that averaging matters."""
    rng = np.random.default_rng(11 + salt + 1000 * ringplug.rank())
    x = rng.normal(size=(B * STEPS, WIDTH)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(WIDTH, WIDTH))).astype("float32")
    return x, y


def make_model(seed: int) -> keras.Model:
    """Six equal Dense layers: twelve tensors that deal evenly to 2 and to 3 ranks."""
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(LAYERS - 1)]
    return keras.Sequential([keras.Input((WIDTH,)), *layers, keras.layers.Dense(WIDTH)])


def make_optimizer(kind: str, mode: str) -> keras.optimizers.Optimizer:
    extra: dict = {}
    if "global_clipnorm" in mode:
        extra["global_clipnorm"] = 0.05  # below the gradients' norm: clipping happens
    if "accumulate" in mode:
        extra["gradient_accumulation_steps"] = 2
    if mode == "clipnorm":
        extra["clipnorm"] = 0.02
    elif mode == "ema":  # averages overwrite the weights every 5 steps and at the end
        extra.update(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=5)
    if kind == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9, **extra)
    if kind == "adam":
        return keras.optimizers.Adam(0.01, **extra)
    return keras.optimizers.AdamW(0.01, weight_decay=0.05, **extra)


def flat(values: list) -> np.ndarray:
    arrays = [np.asarray(keras.ops.convert_to_numpy(v), np.float64).ravel() for v in values]
    return np.concatenate(arrays) if arrays else np.zeros(0)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def identical_everywhere(values: np.ndarray) -> bool:
    everyone = ringplug.allgather_object(values.tobytes())
    return all(v == everyone[0] for v in everyone)


def slot_bytes(optimizer: keras.optimizers.Optimizer) -> int:
    """Bytes of the optimizer's per-variable state (its slots; not the step counter or LR)."""
    scalars = {id(optimizer._iterations), id(getattr(optimizer, "_learning_rate", None))}
    return sum(
        int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in optimizer.variables
        if id(v) not in scalars
    )


def train(zero: int, kind: str, mode: str, model_seed: int = 5, epochs: int = 2,
          make=make_model, callbacks=(), salt: int = 0, models=None) -> keras.Model:  # fmt: skip
    x, y = data(salt)
    if make is make_model and model_seed is not None:
        model = make(model_seed + ringplug.rank())  # RingBroadcast makes them rank 0's
    else:
        model = make(model_seed)
    if models is not None:
        models.append(model)  # for callbacks made before the model
    optimizer = rk.DistributedOptimizer(make_optimizer(kind, mode), zero=zero)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[rk.RingBroadcast(0), *callbacks])  # fmt: skip
    return model


def scenario_equal() -> dict:
    found = {}
    for kind in ("sgd", "adam", "adamw"):
        for mode in ("plain", "global_clipnorm+accumulate", "clipnorm", "ema"):
            if mode in ("clipnorm", "ema") and kind != {"clipnorm": "sgd", "ema": "adam"}[mode]:
                continue  # local to each owner: once is enough
            epochs = 4 if "accumulate" in mode else 2  # 20 updates of 2 batches each
            plain = train(0, kind, mode, epochs=epochs)
            sharded = train(1, kind, mode, epochs=epochs)
            weights = flat(sharded.weights)
            found[f"{kind}-{mode}"] = {
                "relative_difference": relative(weights, flat(plain.weights)),
                "ranks_identical": identical_everywhere(weights),
                "moved": relative(weights, flat(make_model(5).weights)) > 1e-3,
                "steps": int(keras.ops.convert_to_numpy(sharded.optimizer.iterations)),
                "state_bytes": slot_bytes(sharded.optimizer),
                "unsharded_state_bytes": slot_bytes(plain.optimizer),
            }
    return found


def tiny_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(1, use_bias=False)])


def scenario_empty() -> dict:
    """One trainable variable on 2 or 3 ranks: every rank but one owns nothing."""
    found = {}
    for kind, mode in (("adam", "global_clipnorm"), ("sgd", "global_clipnorm+accumulate")):
        plain = train(0, kind, mode, make=tiny_model)
        sharded = train(1, kind, mode, make=tiny_model)
        weights = flat(sharded.weights)
        found[f"{kind}-{mode}"] = {
            "relative_difference": relative(weights, flat(plain.weights)),
            "ranks_identical": identical_everywhere(weights),
            "state_bytes": slot_bytes(sharded.optimizer),
            "steps": int(keras.ops.convert_to_numpy(sharded.optimizer.iterations)),
        }
    return found


class Snapshot(keras.callbacks.Callback):
    """At the start of fit (after RingBroadcast restored the backup): the weights, and on
    rank 0 the whole optimizer state (consolidated there)."""

    def on_train_begin(self, logs=None) -> None:
        optimizer = self.model.optimizer
        rk.consolidate(optimizer, to=0)
        self.weights = flat(self.model.weights)
        self.state = _whole_state(optimizer) if ringplug.rank() == 0 else None
        self.steps = int(keras.ops.convert_to_numpy(optimizer.iterations))


def _whole_state(optimizer) -> np.ndarray:
    """The optimizer's whole state as saved (what save_own_variables writes), flat."""
    store: dict = {}
    optimizer.save_own_variables(store)
    return np.concatenate(
        [np.asarray(store[str(i)], np.float64).ravel() for i in range(len(store))]
    )


def scenario_backup_write(outdir: Path) -> dict:
    """Train sharded Adam 2 epochs with a kept backup; save what it holds to compare."""
    backup = outdir / "backup"
    shutil.rmtree(backup, ignore_errors=True)
    keep = keras.callbacks.BackupAndRestore(str(backup), delete_checkpoint=False)
    model = train(1, "adam", "global_clipnorm", callbacks=[keep])
    rk.consolidate(model.optimizer, to=0)
    if ringplug.rank() == 0:
        np.savez(outdir / "backup-expected.npz", weights=flat(model.weights),
                 state=_whole_state(model.optimizer))  # fmt: skip
    ringplug.barrier()
    return {"written_by": ringplug.size(), "files": sorted(os.listdir(backup))}


def scenario_backup_read(outdir: Path) -> dict:
    """Restore the backup another job wrote (on another number of ranks), sharded and
    not; both then train one more epoch, which must end in the same weights."""
    source = Path(os.environ["ZERO_BACKUP_FROM"])
    expected = np.load(source / "backup-expected.npz")
    found = {}
    for zero in (1, 0):
        copy = outdir / f"restore-{zero}"
        if ringplug.rank() == 0:
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(source / "backup", copy)
        ringplug.barrier()
        snapshot = Snapshot()
        restore = keras.callbacks.BackupAndRestore(str(copy), delete_checkpoint=False)
        model = train(zero, "adam", "global_clipnorm", model_seed=77, epochs=3,
                      callbacks=[restore, snapshot])  # fmt: skip
        entry = {
            "restored_steps": snapshot.steps,
            "weights_restored": relative(snapshot.weights, expected["weights"]),
            "final": flat(model.weights).tolist(),
            "steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        }
        if snapshot.state is not None:
            entry["state_restored"] = relative(snapshot.state, expected["state"])
            entry["state_length"] = [len(snapshot.state), len(expected["state"])]
        found[f"zero{zero}"] = entry
    final = [np.array(found[k].pop("final")) for k in ("zero1", "zero0")]
    found["continued_relative_difference"] = relative(final[0], final[1])
    return found


def scenario_save_load(outdir: Path) -> dict:
    """A sharded fit saved by rank 0 (after consolidate) loads in one process, with the
    unsharded run's whole optimizer state, and trains on; so do rank 0's ModelCheckpoints
    (by epoch and by batches) given through on_rank_zero, with nothing else to call."""
    plain = train(0, "adamw", "plain")
    sharded = train(1, "adamw", "plain")
    checkpoint = outdir / "checkpoint.keras"
    by_batches = outdir / "checkpoint-batches.keras"  # 10 batches an epoch: the last is saved
    saving = rk.on_rank_zero(
        keras.callbacks.ModelCheckpoint(str(checkpoint)),
        keras.callbacks.ModelCheckpoint(str(by_batches), save_freq=10),
    )
    train(1, "adamw", "plain", callbacks=saving)
    found: dict = {}
    try:  # without consolidating first: refused, saying what to do
        sharded.save(str(outdir / f"refused-{ringplug.rank()}.keras"))
        found["refused"] = None
    except RuntimeError as error:
        found["refused"] = str(error)
    rk.consolidate(sharded.optimizer, to=0)
    expected_state = flat(plain.optimizer.variables)
    if ringplug.rank() == 0:
        path = outdir / "sharded.keras"
        sharded.save(str(path))
        loaded = keras.models.load_model(str(path))  # plain Keras, no ringplug involved
        optimizer = loaded.optimizer
        found["class"] = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        found["plain_class"] = not hasattr(optimizer, "_ringplug")
        found["state_relative_difference"] = relative(flat(optimizer.variables), expected_state)
        found["weights_relative_difference"] = relative(flat(loaded.weights), flat(plain.weights))
        x, y = data()
        before = int(keras.ops.convert_to_numpy(optimizer.iterations))
        history = loaded.fit(x[:B], y[:B], batch_size=B, epochs=1, verbose=0)
        found["trained_on"] = int(keras.ops.convert_to_numpy(optimizer.iterations)) - before
        found["loss_finite"] = bool(np.isfinite(history.history["loss"][0]))
        checkpointed = keras.models.load_model(str(checkpoint)).optimizer
        found["checkpoint_state_relative_difference"] = relative(
            flat(checkpointed.variables), expected_state
        )
        checkpointed = keras.models.load_model(str(by_batches)).optimizer
        found["batches_checkpoint_state_relative_difference"] = relative(
            flat(checkpointed.variables), expected_state
        )
    ringplug.barrier()
    return found


def main() -> None:
    outdir = Path(sys.argv[1])
    ringplug.init()
    report: dict = {"backend": keras.backend.backend(), "size": ringplug.size()}
    for scenario in sys.argv[2:]:
        run = globals()[f"scenario_{scenario}"]
        takes_dir = scenario in ("backup_write", "backup_read", "save_load")
        began = time.perf_counter()
        report[scenario] = run(outdir) if takes_dir else run()
        report[f"{scenario}_seconds"] = round(time.perf_counter() - began, 1)
    (outdir / f"zero-{ringplug.rank()}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
