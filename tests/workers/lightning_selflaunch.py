"""`python lightning_selflaunch.py DEVICES [fail [MARKER [FOLDER]]]`: a plain script that asks
Lightning for DEVICES ranks through strategy="ring"; every rank prints its facts after fit.
With FOLDER, every rank first starts helper processes and records them there, as
children.py does."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import ringplug

if len(sys.argv) > 4 and "PMI_RANK" in os.environ:
    from children import record_helpers

    record_helpers(Path(sys.argv[4]), 0, int(os.environ["PMI_RANK"]))


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, _):
        if len(sys.argv) > 2 and sys.argv[2] == "fail" and ringplug.rank() == 1:
            raise RuntimeError("rank 1 fails during training")
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = L.Trainer(
    strategy="ring",
    accelerator="cpu",
    devices=int(sys.argv[1]),
    max_epochs=1,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
)
trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=4))
print(
    f"fitted rank={ringplug.rank()} size={ringplug.size()} world={trainer.world_size}", flush=True
)
