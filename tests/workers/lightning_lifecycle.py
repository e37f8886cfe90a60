"""Multi-rank worker: fit with validation and EarlyStopping, checkpoint and resume, then
validate, test and predict, under RingStrategy; ranks that drift apart stop at the
checkpoint. Writes OUTDIR/lifecycle-<rank>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ringplug
import ringplug.torch as rpt
from ringplug.lightning import RingStrategy


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, _):
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)
        # Differs by rank on purpose and is not synced: rank 1 asks to stop after epoch 0.
        self.log(
            "stop_signal",
            float(ringplug.rank() == 1) * (self.current_epoch + 1),
            sync_dist=False,
            rank_zero_only=False,
        )

    def test_step(self, batch, _):
        x, y, _ = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def predict_step(self, batch, _):
        return batch[2]  # the sample ids this rank was given

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Drifting(Model):
    """Its weight decay differs by rank (a mistake the averaged gradients cannot undo)."""

    def configure_optimizers(self):
        decay = 0.01 * (ringplug.rank() + 1)
        return torch.optim.SGD(self.parameters(), lr=0.05, weight_decay=decay)


def dataset(rows: int = 40) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 4, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True), torch.arange(rows))


def trainer(outdir: Path, epochs: int, callbacks: list) -> L.Trainer:
    return L.Trainer(
        strategy=RingStrategy(),
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=outdir,
        callbacks=callbacks,
    )


def main(outdir: Path) -> None:
    ringplug.init()
    rank = ringplug.rank()
    model = Model()
    loader = DataLoader(dataset(), batch_size=4)
    checkpoints = outdir / "checkpoints"
    stopper = EarlyStopping(
        monitor="stop_signal", mode="max", stopping_threshold=0.5, check_on_train_epoch_end=False
    )
    saver = ModelCheckpoint(dirpath=checkpoints, save_last=True)
    fit = trainer(outdir, 5, [stopper, saver])
    fit.fit(model, loader, loader)
    report = {
        "stopped_epoch": fit.current_epoch,
        "is_global_zero": fit.is_global_zero,
        "val_loss": float(fit.callback_metrics["val_loss"]),
    }
    ringplug.barrier()
    report["checkpoints"] = sorted(p.name for p in checkpoints.iterdir())
    resumed_model = Model()
    resume = trainer(outdir, fit.current_epoch + 2, [])
    resume.fit(resumed_model, loader, ckpt_path=str(checkpoints / "last.ckpt"))
    flat = torch.cat([p.detach().reshape(-1) for p in resumed_model.parameters()])
    everyone = rpt.allgather(flat.unsqueeze(0))
    report["resumed_identical"] = all(torch.equal(row, everyone[0]) for row in everyone)
    report["resumed_epochs"] = resume.current_epoch
    report["validate"] = float(resume.validate(resumed_model, loader, verbose=False)[0]["val_loss"])
    report["test"] = float(resume.test(resumed_model, loader, verbose=False)[0]["test_loss"])
    predicted = resume.predict(resumed_model, loader)
    report["predicted_ids"] = sorted(int(i) for batch in predicted for i in batch)
    drift = outdir / "drift"
    try:
        trainer(drift, 1, [ModelCheckpoint(dirpath=drift / "checkpoints")]).fit(Drifting(), loader)
        report["drift"] = None
    except rpt.RanksDisagreeError as error:
        report["drift"] = {
            "tensor": error.tensor,
            "groups": error.groups,
            "message": str(error),
            "written": sorted(p.name for p in (drift / "checkpoints").iterdir()),
        }
    (outdir / f"lifecycle-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
