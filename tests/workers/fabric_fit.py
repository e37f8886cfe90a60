"""Multi-rank worker: Lightning Fabric with ringplug trains like one process on the union of
the ranks' batches.

``python fabric_fit.py PACKAGE STRATEGY DEVICES OUTDIR``: PACKAGE is ``lightning.fabric`` or
``lightning_fabric``, STRATEGY ``ring`` (the registered name) or ``class``
(``RingFabricStrategy()``), DEVICES Fabric's ``devices`` (``auto`` under ringrun; N to have
``python fabric_fit.py`` start N ranks itself). Each rank writes OUTDIR/fabric-<rank>.json
with what it trained and what the collectives returned; the test computes what they must be.

A plain torch reference is trained on every rank, locally, on the union of the ranks'
batches (which every rank can make), from rank 0's initial weights:
- plain: `STEPS` steps of `BATCH` rows per rank, SGD with a step LR schedule;
- accumulate: the next model, 2 micro-batches per step under ``fabric.no_backward_sync``,
  against the reference's one big batch per step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ringplug  # registers strategy="ring" with the Fabric this script imports

BATCH, STEPS, LR = 4, 4, 0.2
PACKAGE, STRATEGY, DEVICES, OUTDIR = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])

if PACKAGE == "lightning_fabric":
    from lightning_fabric import Fabric

    from ringplug.lightning_fabric import RingFabricStrategy
else:
    from lightning.fabric import Fabric

    from ringplug.fabric import RingFabricStrategy


def make_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))


def data(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    rows = BATCH * size * STEPS
    return TensorDataset(
        torch.randn(rows, 6, generator=generator), torch.randn(rows, 2, generator=generator)
    )


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in module.state_dict().values()])


def reference(size: int, accumulate: int) -> torch.nn.Module:
    """One process, plain torch: each step's batch is the union of every rank's batches.

    Fabric shuffles with a DistributedSampler (seed 0, epoch 0), which gives each rank the
    same order as torch's sampler here."""
    net = make_net(seed=10)  # rank 0's initial weights
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    dataset = data(size)
    orders = [
        list(DistributedSampler(dataset, num_replicas=size, rank=r, shuffle=True, seed=0))
        for r in range(size)
    ]
    for step in range(STEPS // accumulate):
        optimizer.zero_grad()
        span = slice(step * accumulate * BATCH, (step + 1) * accumulate * BATCH)
        rows = [i for order in orders for i in order[span]]
        x, y = dataset[rows]
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
        if accumulate == 1:
            schedule.step()
    return net


def train(fabric: Fabric, accumulate: int) -> dict:
    """Train a model whose initial weights differ on every rank; report how it went."""
    rank, size = fabric.global_rank, fabric.world_size
    net = make_net(seed=10 + rank)  # fabric.setup must hand every rank rank 0's
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    if accumulate == 1:
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer, schedule = fabric.setup(net, optimizer, scheduler=schedule)
    else:
        model, optimizer = fabric.setup(net, optimizer)
    initial = flat(model)
    loader = fabric.setup_dataloaders(DataLoader(data(size), batch_size=BATCH, shuffle=True))
    engine = ringplug.core.runtime.engine()
    before = engine.collectives_run
    grads = []
    for index, (x, y) in enumerate(loader):
        last = (index + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = torch.nn.functional.mse_loss(model(x), y) / accumulate
            fabric.backward(loss)
        if not last:
            continue
        # Read before step: fabric.backward returned with the gradients averaged.
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        optimizer.step()
        optimizer.zero_grad()
        if accumulate == 1:
            schedule.step()
    collectives = engine.collectives_run - before
    weights = flat(model)
    expected = flat(reference(size, accumulate))
    everyone = fabric.all_gather(weights)
    all_grads = fabric.all_gather(torch.stack(grads))
    return {
        "setup_gave_rank_zeros_weights": bool(torch.equal(initial, flat(make_net(seed=10)))),
        "max_difference": float((weights - expected).abs().max()),
        "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
        "grads_identical_after_backward": all(torch.equal(g, all_grads[0]) for g in all_grads),
        "steps": len(grads),
        "collectives": collectives,
        "sampler": [
            type(loader.sampler).__name__,
            loader.sampler.num_replicas,
            loader.sampler.rank,
        ],
    }


def collectives(fabric: Fabric) -> dict:
    """What Fabric's collectives return for rank-dependent inputs."""
    rank = fabric.global_rank
    mine = torch.tensor([rank + 1.0, -2.0 * (rank + 1)])
    given = mine.clone()
    reduced = {
        op: fabric.all_reduce(mine, reduce_op=op).tolist() for op in ("mean", "sum", "max", "min")
    }
    counter = fabric.all_reduce(torch.tensor(rank + 1), reduce_op="mean")
    nested = fabric.all_reduce(
        {"a": torch.tensor(float(rank)), "b": [torch.tensor(1.0)]}, reduce_op="sum"
    )
    gathered = fabric.all_gather(torch.arange(3) + 10 * rank)
    fabric.barrier()
    root = 1 if fabric.world_size > 1 else 0
    return {
        "all_reduce": reduced,
        "input_unchanged": bool(torch.equal(mine, given)),
        "int_mean": [counter.item(), str(counter.dtype)],
        "nested_sum": [nested["a"].item(), nested["b"][0].item()],
        "all_gather": gathered.tolist(),
        "broadcast": fabric.broadcast({"from": rank, "text": f"rank {rank}"}, src=root),
        "all_agree": fabric.strategy.reduce_boolean_decision(rank == 0, all=True),
        "any_agrees": fabric.strategy.reduce_boolean_decision(rank == 0, all=False),
    }


def main() -> None:
    strategy = "ring" if STRATEGY == "ring" else RingFabricStrategy()
    devices = DEVICES if DEVICES == "auto" else int(DEVICES)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=devices)
    fabric.launch()  # with devices=N outside a launcher, this re-runs the script as N ranks
    report = {
        "rank": ringplug.rank(),
        "size": ringplug.size(),
        "fabric": [fabric.global_rank, fabric.world_size, fabric.is_global_zero],
        "strategy": f"{type(fabric.strategy).__module__}.{type(fabric.strategy).__name__}",
        "other_fabric_imported": (
            "lightning" if PACKAGE == "lightning_fabric" else "lightning_fabric"
        )
        in sys.modules,
        "plain": train(fabric, accumulate=1),
        "accumulate": train(fabric, accumulate=2),
        **collectives(fabric),
    }
    (OUTDIR / f"fabric-{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
