"""Multi-rank worker: the step-time verdict of RingStrategy fits with planted bottlenecks.

``python diagnose_lightning.py OUTDIR SCENARIO ...`` runs each fit in this one process (to
pay for importing Lightning once) and writes OUTDIR/<scenario>-<rank>.json with the
diagnosis. Planted on rank 1: a loader that sleeps per batch ("data"), a training_step that
sleeps ("straggler"); on every rank: a 32 MiB embedding table of which a step uses 2 rows
("communication"), a training_step that sleeps ("compute": the sleep stands in for work on
an accelerator, which the CPU waits for, and keeps the ranks' compute equal on a loaded
machine, where real CPU work on two ranks differs by half from step to step), a
2-parameter model with nothing planted ("tiny": its reduction is round trips, not bytes).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import ringplug
from ringplug.lightning import RingStrategy

PLANTED_SLEEP_S = 0.04  # planted load, many times the step's own work
STEPS = 16


def shapes(scenario: str) -> tuple[int, int, int]:
    """(features, hidden, batch) of each scenario's model and data."""
    if scenario == "communication":
        return 1 << 16, 128, 2  # a 32 MiB table, next to nothing to compute
    if scenario == "tiny":
        return 1, 1, 8  # Linear(1, 1): a weight and a bias, 8 bytes of gradients
    return 16, 32, 8


class Net(L.LightningModule):
    def __init__(self, scenario: str) -> None:
        super().__init__()
        self.scenario = scenario
        features, hidden, _ = shapes(scenario)
        first = torch.nn.Embedding(features, hidden) if scenario == "communication" else None
        self.embedding = first
        alone = first is not None or scenario == "tiny"
        layers = [] if alone else [torch.nn.Linear(features, hidden), torch.nn.Tanh()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        if self.scenario == "compute" or (self.scenario == "straggler" and ringplug.rank() == 1):
            time.sleep(PLANTED_SLEEP_S)
        (x,) = batch
        if self.embedding is not None:
            x = self.embedding(x)
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def slow_collate(batch):
    time.sleep(PLANTED_SLEEP_S)  # rank 1's loader: decoding that takes its time
    return batch


def fit(scenario: str, outdir: Path) -> dict:
    features, _, batch = shapes(scenario)
    size = ringplug.size()
    # Items are whole batches (batch_size=None), so that loading costs no collation.
    items = size * (STEPS + 1)
    if scenario == "communication":
        data = TensorDataset(torch.randint(0, features, (items, batch)))
    else:
        data = TensorDataset(torch.randn(items, batch, features))
    collate = slow_collate if scenario == "data" and ringplug.rank() == 1 else None
    loader = DataLoader(data, batch_size=None, collate_fn=collate)
    traced = scenario == "data"
    trainer = L.Trainer(
        strategy=RingStrategy(timeline=str(outdir / "timeline.json") if traced else None),
        accelerator="cpu",
        max_epochs=1,
        logger=CSVLogger(outdir, name=scenario),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(scenario), loader)
    diagnosis = trainer.strategy._diagnostics.diagnosis
    return {**diagnosis.as_dict(), "table": diagnosis.table()}


def main() -> None:
    ringplug.init()
    outdir = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        report = fit(scenario, outdir)
        path = outdir / f"{scenario}-{ringplug.rank()}.json"
        path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
