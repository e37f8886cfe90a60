"""Multi-rank worker: a Horovod-style torch loop whose ranks have different batch counts.

``python torch_join.py COUNTS OUTDIR``: rank r trains on COUNTS[r] batches with
`ringplug.torch.DistributedOptimizer`, then calls ``ringplug.join()``; while it waits, the
ranks still training reduce with its zeros (Average divides by every rank). Afterwards the
ranks copy the weights and optimizer state of the rank that joined last, so every rank
ends with the reference weights: plain torch over every rank's batches, each step's
gradient the sum of the gradients of the ranks that had a batch, divided by the number of
ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import ringplug
import ringplug.torch as rpt

BATCH, LR = 3, 0.1


def batches_of(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(count, BATCH, 4, generator=generator)
    return [(x[i], x[i].sum(1, keepdim=True)) for i in range(count)]


def make_net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def main(counts: list[int], outdir: Path) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    net = make_net()
    optimizer = rpt.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=LR, momentum=0.5),
        named_parameters=net.named_parameters(),
    )
    for x, y in batches_of(rank, counts[rank]):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    last = ringplug.join()
    rpt.broadcast_parameters(net.state_dict(), root_rank=last)
    rpt.broadcast_optimizer_state(optimizer, root_rank=last)

    reference = make_net()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.5)
    data = [batches_of(r, n) for r, n in enumerate(counts)]
    for step in range(max(counts)):
        ref_optimizer.zero_grad()
        for rank_batches in data:
            if step < len(rank_batches):
                x, y = rank_batches[step]
                (torch.nn.functional.mse_loss(reference(x), y) / size).backward()
        ref_optimizer.step()
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    everyone = rpt.allgather(weights.unsqueeze(0))
    report = {
        "last": last,
        "max_difference": float((weights - expected).abs().max()),
        "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
    }
    (outdir / f"{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main([int(c) for c in sys.argv[1].split(",")], Path(sys.argv[2]))
