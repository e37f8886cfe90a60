"""A Horovod-style elastic torch training (only ``hvd.*`` names): ``python hvd_elastic.py DIR``.

240 samples, batches of 4, 2 epochs, a commit every 3 batches and at each epoch's end,
with an `ElasticSampler` recording its batches. Rank 2 of the first start SIGKILLs itself
one batch after its 5th commit (after writing DIR/kill.json with the time, rank and step);
ELASTIC_KILL_RANK and ELASTIC_KILL_STEP choose another rank, and the step (batches trained
in the first start, counted over its epochs) after which it dies, before that step's
commit. Every rank writes, to DIR:

  ledger.<restart>.<rank>  one JSON line a commit: the commit number, and the epoch and ids
                           of the samples this rank trained since the commit before
  batches.<restart>.<rank> one JSON line a batch: its epoch, the commits made before it,
                           its ids and loss, and the time it ended
  start.<restart>.<rank>   the state `train` began with, the world size and the job id
  reset.<restart>.<rank>   one line each time a reset callback ran
  final.<restart>.<rank>   the final weights
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import ringplug.horovod.torch as hvd

BATCH = 4
KILL_RANK = int(os.environ.get("ELASTIC_KILL_RANK", "2"))
KILL_STEP = os.environ.get("ELASTIC_KILL_STEP")  # unset: one batch after the 5th commit


def kill_now(commits: int, steps: int) -> bool:
    """Whether the victim of the first start dies after its batch number `steps`."""
    return commits == 5 if KILL_STEP is None else steps == int(KILL_STEP)


def main(folder: Path) -> None:
    hvd.init()
    rank, restart = hvd.rank(), int(os.environ["RINGPLUG_RESTART"])
    torch.manual_seed(rank)  # different on purpose: the sync must make them equal
    features = torch.randn(240, 8, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(features, features.sum(1, keepdim=True), torch.arange(240))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def on_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * hvd.size()
        with open(folder / f"reset.{restart}.{rank}", "a") as out:
            out.write(f"{hvd.size()}\n")

    def commit(state, trained: list[int], epoch: int) -> None:
        state.commits += 1
        state.commit()
        with open(folder / f"ledger.{restart}.{rank}", "a") as out:
            line = {"commit": state.commits, "epoch": epoch, "ids": trained}
            out.write(json.dumps(line) + "\n")
        trained.clear()

    @hvd.elastic.run
    def train(state) -> None:
        start = {
            "epoch": state.epoch,
            "batch": state.batch,
            "commits": state.commits,
            "size": hvd.size(),
            "job": os.environ.get("RINGPLUG_JOB_ID"),
            "lr": optimizer.param_groups[0]["lr"],
        }
        (folder / f"start.{restart}.{rank}").write_text(json.dumps(start))
        trained: list[int] = []
        steps = 0
        batches = open(folder / f"batches.{restart}.{rank}", "a")  # noqa: SIM115
        while state.epoch < 2:
            state.train_sampler.set_epoch(state.epoch)
            for state.batch, (x, y, ids) in enumerate(loader):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(state.model(x), y)
                loss.backward()
                optimizer.step()
                trained.extend(ids.tolist())
                state.train_sampler.record_batch(state.batch, BATCH)
                steps += 1
                line = {
                    "epoch": state.epoch,
                    "commits": state.commits,
                    "ids": ids.tolist(),
                    "loss": loss.item(),
                    "time": time.time(),
                }
                batches.write(json.dumps(line) + "\n")
                batches.flush()
                if restart == 0 and rank == KILL_RANK and kill_now(state.commits, steps):
                    killed = {"time": time.time(), "rank": rank, "step": steps}
                    (folder / "kill.json").write_text(json.dumps(killed))
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-interval: uncommitted batches
                if (state.batch + 1) % 3 == 0:
                    commit(state, trained, state.epoch)
            state.epoch, state.batch = state.epoch + 1, 0
            state.train_sampler.set_epoch(state.epoch)
            commit(state, trained, state.epoch - 1)

    state = hvd.elastic.TorchState(
        model, optimizer, train_sampler=sampler, epoch=0, batch=0, commits=0
    )
    state.register_reset_callbacks([on_reset])
    train(state)
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    (folder / f"final.{restart}.{rank}").write_text(json.dumps(weights))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
