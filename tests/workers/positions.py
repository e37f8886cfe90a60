"""Multi-rank worker: a stall report says where in training the missing rank is.

``python positions.py SCENARIO OUTDIR`` on 2 ranks, with a short RINGPLUG_STALL_CHECK_SECONDS.
Scenarios: ``lightning`` (a RingStrategy fit) and ``keras`` (a fit with RingBroadcast, on
the backend in KERAS_BACKEND), 2 epochs of 6 batches. Rank 1 holds in its forward pass at
epoch 1, batch 3 (step 9), until rank 0 has warned about the stall, so rank 0 waits in that
batch's gradient reduction.
Rank 0 writes each stall warning it logs while rank 1 holds to OUTDIR/stall.txt, which is
also what lets rank 1 go on; every rank writes OUTDIR/<scenario>-<rank>.json at the end.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

import ringplug

HELD_EPOCH, HELD_BATCH = 1, 3
EPOCHS = 2
BATCHES, PER_RANK, FEATURES = 6, 4, 5
HOLD_LIMIT_S = 60.0  # a bound on the wait for rank 0's warning, not a synchronisation


class StallWarnings(logging.Handler):
    """Rank 0: writes the stall warnings logged while rank 1 holds, which releases rank 1."""

    def __init__(self, outdir: Path) -> None:
        super().__init__(logging.WARNING)
        self.outdir = outdir

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "Stalled collectives" in text and (self.outdir / "holding").exists():
            partial = self.outdir / "stall.part"
            with partial.open("a") as file:
                file.write(text + "\n")
            partial.replace(self.outdir / "stall.txt")  # appears whole


def hold_if_due(outdir: Path, epoch: int, batch: int) -> None:
    """Rank 1 at the held batch: wait (bounded) until rank 0 has warned about it."""
    if ringplug.rank() != 1 or (epoch, batch) != (HELD_EPOCH, HELD_BATCH):
        return
    (outdir / "holding").touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not (outdir / "stall.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def data() -> tuple[np.ndarray, np.ndarray]:
    """This rank's own rows: BATCHES batches of PER_RANK."""
    rng = np.random.default_rng(5 + ringplug.rank())
    x = rng.normal(size=(BATCHES * PER_RANK, FEATURES)).astype("float32")
    return x, (x @ np.ones((FEATURES, 1), np.float32)).astype("float32")


def fit_lightning(outdir: Path) -> None:
    import torch
    from lightning_namespace import L, RingStrategy
    from torch.utils.data import DataLoader, TensorDataset

    class Held(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(FEATURES, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            hold_if_due(outdir, self.current_epoch, batch_idx)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x, y = data()
    loader = DataLoader(
        TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=PER_RANK
    )
    trainer = L.Trainer(
        strategy=RingStrategy(),
        accelerator="cpu",
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Held(), loader)


def fit_keras(outdir: Path) -> None:
    import keras

    import ringplug.keras as rk

    position = {"epoch": -1, "batch": -1}

    class Position(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            position["epoch"] = epoch

        def on_train_batch_begin(self, batch, logs=None):
            position["batch"] = batch

    def hold(value):
        hold_if_due(outdir, position["epoch"], position["batch"])
        return value

    class Hold(keras.layers.Layer):
        """Identity; its forward pass holds rank 1 at the held batch."""

        def call(self, x):
            if keras.backend.backend() == "tensorflow":
                import tensorflow as tf

                held = tf.numpy_function(hold, [tf.reduce_sum(x)], x.dtype, stateful=True)
                held.set_shape([])
                return x + 0.0 * tf.stop_gradient(held)
            hold(None)
            return x

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1), Hold()])
    model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = data()
    model.fit(
        x,
        y,
        batch_size=PER_RANK,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[rk.RingBroadcast(0), Position()],
    )


def main(scenario: str, outdir: Path) -> None:
    ringplug.init()
    if ringplug.rank() == 0:
        logging.getLogger("ringplug").addHandler(StallWarnings(outdir))
    {"lightning": fit_lightning, "keras": fit_keras}[scenario](outdir)
    report = {"phase after fit": ringplug.core.activity.current()[0]}
    (outdir / f"{scenario}-{ringplug.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
