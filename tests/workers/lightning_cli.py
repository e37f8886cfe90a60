"""Multi-rank worker: a LightningCLI script whose YAML (or command line) picks RingStrategy
(the LightningCLI of the Lightning `lightning_namespace` picks).

``python lightning_cli.py fit --config CONFIG --report OUTDIR`` trains a small model; each
rank writes OUTDIR/cli-<rank>.json with the strategy it ran under and its settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning_namespace import L, lightning_cli
from torch.utils.data import DataLoader, TensorDataset

import ringplug
import ringplug.torch as rpt


class Regressor(L.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(ringplug.rank() if ringplug.is_initialized() else 0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
        )
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(5))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Report(L.Callback):
    """Writes what this rank trained under, after fit."""

    def __init__(self, outdir: str = "") -> None:
        self.outdir = outdir

    def on_fit_end(self, trainer, module) -> None:
        strategy = trainer.strategy
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        everyone = rpt.allgather(flat.unsqueeze(0))
        report = {
            "strategy": f"{type(strategy).__module__}.{type(strategy).__name__}",
            "compression": str(getattr(strategy, "compression", None)),
            "bucket_bytes": getattr(strategy, "bucket_bytes", None),
            "world_size": trainer.world_size,
            "steps": trainer.global_step,
            "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
        }
        path = Path(self.outdir) / f"cli-{trainer.global_rank}.json"
        path.write_text(json.dumps(report))


if __name__ == "__main__":
    lightning_cli()(Regressor, save_config_callback=None)
