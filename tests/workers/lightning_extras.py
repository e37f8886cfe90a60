"""Multi-rank worker: manual optimization with two optimizers, DataLoader workers, and a
torchmetrics metric synced over ranks, under RingStrategy. Writes OUTDIR/extras-<rank>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

import ringplug
import ringplug.torch as rpt
from ringplug.lightning import RingStrategy


class TwoOptimizers(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(ringplug.rank())  # differs per rank: setup broadcasts rank 0's
        self.encoder = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 1)
        self.total = torchmetrics.SumMetric()

    def training_step(self, batch, _):
        x, y, ids = batch
        first, second = self.optimizers()
        loss = torch.nn.functional.mse_loss(self.head(self.encoder(x)), y)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        self.total.update(ids.float())  # synced over ranks when computed

    def on_train_epoch_end(self) -> None:
        self.log("ids_total", self.total.compute(), sync_dist=False)

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.encoder.parameters(), lr=0.1),
            torch.optim.Adam(self.head.parameters(), lr=0.01),
        )


def main(outdir: Path) -> None:
    ringplug.init()
    rows = 32
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, x.sum(1, keepdim=True), torch.arange(rows))
    model = TwoOptimizers()
    trainer = L.Trainer(
        strategy=RingStrategy(),
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=4, num_workers=2))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = rpt.allgather(flat.unsqueeze(0))
    report = {
        "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
        "trained": bool(trainer.global_step > 0),
        # Every id of both epochs, summed over every rank by torchmetrics' sync.
        "ids_total": float(trainer.callback_metrics["ids_total"]),
        "expected_total": float(2 * sum(range(rows))),
    }
    (outdir / f"extras-{ringplug.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
