"""Multi-rank worker: Lightning's ``prepare_data`` (and Fabric's ``rank_zero_first``) under
RingStrategy, as real data modules use them.

``python lightning_prepare.py SCENARIO OUTDIR``. The ranks that prepare the data append a line
"global_rank local_rank" to OUTDIR/prepared.txt; after fit, each rank writes
OUTDIR/<scenario>-<rank>.json with its rank and a digest of its trained weights.

Scenarios:
- ``per-node``: a LightningDataModule whose ``prepare_data`` runs on local rank 0 of each
  node (Lightning's default, ``prepare_data_per_node=True``).
- ``once``: the same with ``prepare_data_per_node=False``: global rank 0 only.
- ``module``: ``prepare_data`` of the LightningModule itself, no data module.
- ``slow``: ``prepare_data`` takes 6 s (a download), longer than the RINGPLUG_TIMEOUT the test
  sets: the others wait for it.
- ``fails``: ``prepare_data`` raises on the rank that runs it.
- ``hangs``: ``prepare_data`` never returns (the injected fault); the test sets
  RINGPLUG_BARRIER_TIMEOUT short.
- ``fabric``: Fabric's ``rank_zero_first()``, where rank 0 prepares and the others follow.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import ringplug

SCENARIO, OUTDIR = sys.argv[1], Path(sys.argv[2])


def record_preparation() -> None:
    with (OUTDIR / "prepared.txt").open("a") as ledger:
        ledger.write(f"{ringplug.rank()} {ringplug.local_rank()}\n")


def prepare() -> None:
    record_preparation()
    if SCENARIO == "slow":
        time.sleep(6)  # the simulated download itself, not a synchronisation
    elif SCENARIO == "fails":
        raise RuntimeError("the download of the data set failed")
    elif SCENARIO == "hangs":
        threading.Event().wait(120)  # the injected fault: a prepare_data that never returns


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(
            torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator)
        ),
        batch_size=4,
    )


class Data(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.prepare_data_per_node = SCENARIO != "once"

    def prepare_data(self) -> None:
        prepare()

    def train_dataloader(self) -> DataLoader:
        return data()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(ringplug.rank())  # different on every rank: setup broadcasts rank 0's
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PreparingModel(Model):
    def prepare_data(self) -> None:
        prepare()

    def train_dataloader(self) -> DataLoader:
        return data()


def digest(module: torch.nn.Module) -> str:
    weights = b"".join(p.detach().numpy().tobytes() for p in module.parameters())
    return hashlib.sha256(weights).hexdigest()


def fit() -> torch.nn.Module:
    trainer = L.Trainer(
        strategy="ring",
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    if SCENARIO == "module":
        model: Model = PreparingModel()
        trainer.fit(model)
    else:
        model = Model()
        trainer.fit(model, datamodule=Data())
    return model


def fabric() -> torch.nn.Module:
    fabric = L.Fabric(strategy="ring", accelerator="cpu")
    fabric.launch()
    with fabric.rank_zero_first():
        record_preparation()  # rank 0 first, then the others
    model = torch.nn.Linear(4, 1)
    return fabric.setup(model)


if __name__ == "__main__":
    trained = fabric() if SCENARIO == "fabric" else fit()
    report = {"rank": ringplug.rank(), "pid": os.getpid(), "weights": digest(trained)}
    (OUTDIR / f"{SCENARIO}-{ringplug.rank()}.json").write_text(json.dumps(report))
