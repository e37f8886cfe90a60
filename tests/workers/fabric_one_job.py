"""Multi-rank worker: under ringrun, a script written for ``fabric run`` (``Fabric()`` with no
arguments and no ``fabric.launch()``) trains as one job, keeps BatchNorm's buffers within
DDP's bound, and a Trainer or Fabric of one process never trains a copy per rank.

``python fabric_one_job.py PACKAGE OUTDIR`` (PACKAGE ``lightning.fabric`` or
``lightning_fabric``); each rank writes OUTDIR/one_job-<rank>.json. Rank 1's inputs are shifted
by +3, so that its batches move the running statistics away from rank 0's.

- ``unchanged``: ``Fabric()``, no launch; per step, every rank's ``running_mean`` against rank
  0's and the bound DDP keeps (ranks differ by the last forward's update only: momentum x the
  difference of the two batches' means); then ``fabric.save`` and the buffers on every rank.
- ``apart``: the same with ``RingFabricStrategy(broadcast_buffers=False)``.
- ``launch_twice``, ``single_device``, ``devices_3``, ``trainer``: what the second
  ``launch()``, an explicit ``SingleDeviceStrategy``, ``devices=3`` on 2 ranks and a
  ``Trainer(accelerator="cpu")`` do.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import ringplug  # noqa: F401  (the one line a script written for `fabric run` gains)

PACKAGE, OUTDIR = sys.argv[1], Path(sys.argv[2])
STEPS, BATCH, SHIFT = 12, 8, 3.0

if PACKAGE == "lightning_fabric":
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import SingleDeviceStrategy

    from ringplug.lightning_fabric import RingFabricStrategy
else:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import SingleDeviceStrategy

    from ringplug.fabric import RingFabricStrategy


def train(fabric: Fabric, drift_on_rank_1: bool = False) -> dict:
    torch.manual_seed(fabric.global_rank)  # different initial weights: setup must fix them
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(7)
    rows = STEPS * BATCH * fabric.world_size
    dataset = TensorDataset(torch.randn(rows, 4, generator=generator), torch.randn(rows, 1))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=BATCH))
    norm = model.module[0] if hasattr(model, "module") else model[0]
    linear = model.module[1] if hasattr(model, "module") else model[1]
    momentum = norm.momentum
    worst_excess = 0.0  # how far past DDP's bound any step went (0: within it)
    largest = 0.0
    for x, y in loader:
        if fabric.global_rank == 1:
            x = x + SHIFT
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        means = fabric.all_gather(x.mean(0))
        running = fabric.all_gather(norm.running_mean.clone())
        for rank in range(1, fabric.world_size):
            gap = (running[rank] - running[0]).abs()
            bound = momentum * (means[rank] - means[0]).abs()
            worst_excess = max(worst_excess, float((gap - bound).max()))
            largest = max(largest, float(gap.max()))
    # A training-mode forward with no backward moves each rank's statistics its own way;
    # the next forward (evaluation) must start from rank 0's.
    with torch.no_grad():
        model(x)
        model.eval()
        model(x)
        model.train()
    evaluated = fabric.all_gather(norm.running_mean.clone())
    path = OUTDIR / f"saved-{type(fabric.strategy).__name__}-{id(fabric)}.pt"
    fabric.save(path, {"model": model})
    after_save = fabric.all_gather(torch.cat([b.double().reshape(-1) for b in norm.buffers()]))
    parameters = fabric.all_gather(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    drift = None
    if drift_on_rank_1:  # a parameter one rank alone changed: fabric.save's check says so
        with torch.no_grad():
            if fabric.global_rank == 1:
                linear.weight[0, 0] += 1e-3
        try:
            fabric.save(OUTDIR / f"drift-{id(fabric)}.pt", {"model": model})
        except RuntimeError as error:
            drift = f"{type(error).__name__}: {error}"
    return {
        "drift": drift,
        "world_size": fabric.world_size,
        "strategy": type(fabric.strategy).__name__,
        "sampler": type(loader.sampler).__name__,
        "worst_excess_over_ddp_bound": worst_excess,
        "largest_gap": largest,
        "buffers_equal_after_save": all(torch.equal(b, after_save[0]) for b in after_save),
        "buffers_equal_when_evaluating": all(torch.equal(b, evaluated[0]) for b in evaluated),
        "parameters_equal": all(torch.equal(p, parameters[0]) for p in parameters),
    }


def refused(make) -> str | None:
    try:
        make()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return None


def main() -> None:
    report: dict = {"rank": None}
    fabric = Fabric()  # as Lightning's examples written for `fabric run`: no launch()
    report["rank"] = fabric.global_rank
    report["unchanged"] = train(fabric, drift_on_rank_1=True)
    report["launch_once"] = refused(fabric.launch)  # the script's own launch(): accepted
    report["launch_twice"] = refused(fabric.launch)
    apart = Fabric(strategy=RingFabricStrategy(broadcast_buffers=False), accelerator="cpu")
    report["apart"] = train(apart)
    report["single_device"] = refused(lambda: Fabric(strategy=SingleDeviceStrategy("cpu")))
    report["devices_3"] = refused(lambda: Fabric(accelerator="cpu", devices=3))
    report["trainer"] = trainer_world()
    (OUTDIR / f"one_job-{report['rank']}.json").write_text(json.dumps(report))


def trainer_world() -> list:
    if PACKAGE == "lightning_fabric":
        from pytorch_lightning import Trainer
    else:
        from lightning.pytorch import Trainer
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    return [type(trainer.strategy).__name__, trainer.world_size]


if __name__ == "__main__":
    main()
