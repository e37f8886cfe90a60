"""Multi-rank worker: RingStrategy when the ranks have different numbers of batches (in the
Lightning `lightning_namespace` picks).

``python lightning_uneven.py SOURCE MODE COUNTS OUTDIR``: SOURCE is ``iterable`` (an
IterableDataset of per-rank batches, no length) or ``map`` (a per-rank TensorDataset with
``use_distributed_sampler=False``), MODE is RingStrategy's ``uneven`` argument, COUNTS the
batches of each rank (``6,4,5``). Two epochs; each rank writes OUTDIR/<rank>.json with its
weights and the reference weights the mode defines, trained here by plain torch on every
rank's batches (which each rank can make: they come from per-rank seeds).

``python lightning_uneven.py sigterm - - OUTDIR``: rank 1 (only) gets a SIGTERM after its third
step; every rank must stop at the same batch (each writes where it stopped).

``python lightning_uneven.py eval - - OUTDIR``: validate/test/predict on a dataset whose size
does not divide by the number of ranks; the logged epoch means must be the means over every
sample once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from lightning_namespace import L, RingStrategy
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ringplug
import ringplug.torch as rpt

BATCH, EPOCHS, LR = 3, 2, 0.1


def batches_of(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(count * BATCH, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
        count * BATCH, 1, generator=generator
    )
    return [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(count)]


class PerRankBatches(IterableDataset):
    def __init__(self, rank: int, count: int) -> None:
        self.batches = batches_of(rank, count)

    def __iter__(self):
        return iter(self.batches)


def make_net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Linear(4, 1)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        if ringplug.rank():
            with torch.no_grad():  # different on other ranks: setup broadcasts rank 0's
                self.net.weight.add_(1.0)
        self.steps = 0
        self.val_samples = 0

    def training_step(self, batch, _):
        x, y = batch
        self.steps += 1
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True)
        return loss

    def validation_step(self, batch, _):
        (x,) = batch
        self.val_samples += len(x)
        self.log("val_mean", x.mean(), sync_dist=True, batch_size=len(x))
        self.log("val_count", float(len(x)), sync_dist=True, reduce_fx="sum", batch_size=1)

    def test_step(self, batch, _):
        (x,) = batch
        self.log("test_mean", x.mean(), sync_dist=True, batch_size=len(x))

    def predict_step(self, batch, _):
        return batch[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def reference(counts: list[int], mode: str) -> torch.nn.Module:
    """Plain torch on every rank's batches: the weights the mode promises."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    data = [batches_of(r, n) for r, n in enumerate(counts)]
    size = len(counts)
    steps = max(counts) if mode == "join" else min(counts)
    for _ in range(EPOCHS):
        for step in range(steps):
            optimizer.zero_grad()
            for rank_batches in data:
                if step < len(rank_batches):
                    x, y = rank_batches[step]
                    # Each rank's gradient, averaged over every rank (absent ones add zero).
                    (torch.nn.functional.mse_loss(net(x), y) / size).backward()
            optimizer.step()
    return net


def train(source: str, mode: str, counts: list[int], outdir: Path) -> None:
    ringplug.init()
    rank = ringplug.rank()
    if source == "iterable":
        loader = DataLoader(PerRankBatches(rank, counts[rank]), batch_size=None)
    else:
        x = torch.cat([b[0] for b in batches_of(rank, counts[rank])])
        y = torch.cat([b[1] for b in batches_of(rank, counts[rank])])
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    model = Regressor()
    trainer = L.Trainer(
        strategy=RingStrategy(uneven=mode),
        accelerator="cpu",
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, loader)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference(counts, mode).parameters()])
    everyone = rpt.allgather(weights.unsqueeze(0))
    other = reference(counts, "drop" if mode == "join" else "join").parameters()
    other_weights = torch.cat([p.detach().reshape(-1) for p in other])
    report = {
        "max_difference": float((weights - expected).abs().max()),
        # The modes' references differ, so matching one of them says something.
        "other_mode_difference": float((weights - other_weights).abs().max()),
        "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
        "steps": model.steps,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
    }
    (outdir / f"{rank}.json").write_text(json.dumps(report))


def evaluate(outdir: Path) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    samples = 3 * size + 1  # does not divide: ranks get different numbers of samples
    values = torch.arange(samples, dtype=torch.float32).reshape(-1, 1) ** 2
    loader = DataLoader(TensorDataset(values), batch_size=2, shuffle=False)
    model = Regressor()
    trainer = L.Trainer(
        strategy=RingStrategy(),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    validated = trainer.validate(model, loader, verbose=False)[0]
    tested = trainer.test(model, loader, verbose=False)[0]
    predicted = torch.cat(trainer.predict(model, loader))
    everything = rpt.allgather(predicted.reshape(-1))
    report = {
        "val_mean": validated["val_mean"],
        "val_count": validated["val_count"],
        "test_mean": tested["test_mean"],
        "true_mean": float(values.mean()),
        "samples": samples,
        "val_samples_here": model.val_samples,
        "predicted_sorted": sorted(everything.tolist()) == values.reshape(-1).tolist(),
    }
    (outdir / f"{rank}.json").write_text(json.dumps(report))


class SigtermOnRankOne(L.Callback):
    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir

    def on_train_batch_end(self, trainer, *_: object) -> None:
        if ringplug.rank() == 1 and trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, to this rank only

    def on_exception(self, trainer, _, exception: BaseException) -> None:
        report = {"exception": type(exception).__name__, "global_step": trainer.global_step}
        (self.outdir / f"{ringplug.rank()}.json").write_text(json.dumps(report))


def sigterm(outdir: Path) -> None:
    ringplug.init()
    loader = DataLoader(PerRankBatches(ringplug.rank(), 20), batch_size=None)
    trainer = L.Trainer(
        strategy=RingStrategy(),
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[SigtermOnRankOne(outdir)],
    )
    trainer.fit(Regressor(), loader)


if __name__ == "__main__":
    if sys.argv[1] == "eval":
        evaluate(Path(sys.argv[4]))
    elif sys.argv[1] == "sigterm":
        sigterm(Path(sys.argv[4]))
    else:
        train(sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3].split(",")], Path(sys.argv[4]))
