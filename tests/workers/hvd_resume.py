"""Multi-rank worker: Horovod's resume recipe (examples/pytorch/pytorch_imagenet_resnet50.py)
with weight decay keeps every rank bitwise identical, and `check_agreement` names a tensor
that one rank moved.

The recipe: rank 0 loads the model and optimizer from its checkpoint, then every rank calls
``hvd.broadcast_parameters`` and, after it, ``hvd.broadcast_optimizer_state``, whose
state-creating step runs on the ranks that did not load (Horovod's moves their parameters
by lr x weight decay x w, for good). ``python hvd_resume.py OUTDIR`` writes
OUTDIR/resume-<rank>.json: {check: true/false}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from checklist import checker

import ringplug.horovod.torch as hvd
import ringplug.torch as rpt


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


OPTIMIZERS = {
    # The ImageNet example's: SGD with momentum and weight decay (larger than its 5e-5, so
    # that a moved parameter differs in most of its elements).
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=1e-2),
    "adam-maximize": lambda params: torch.optim.Adam(
        params, lr=0.05, weight_decay=1e-2, maximize=True
    ),
}


def build(kind: str) -> tuple[Net, torch.optim.Optimizer]:
    model = Net()
    optimizer = hvd.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()), named_parameters=model.named_parameters()
    )
    return model, optimizer


def train(model: Net, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        data = torch.randn(4, 1, 8, 8, generator=generator)
        target = torch.randint(0, 5, (4,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()


def identical(model: Net, optimizer: torch.optim.Optimizer) -> bool:
    """Every parameter and optimizer state tensor, bitwise the same on every rank."""
    mine = [p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()]
    mine += [
        v.detach().reshape(-1).view(torch.uint8)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    everyone = hvd.allgather_object([t.numpy().tobytes() for t in mine])
    return all(other == everyone[0] for other in everyone)


def main(outdir: Path) -> None:
    hvd.init()
    rank = hvd.rank()
    checks: dict[str, bool] = {}
    check = checker(checks)
    for kind in OPTIMIZERS:
        torch.manual_seed(rank)  # each rank builds its own initial weights, as in the example
        model, optimizer = build(kind)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        train(model, optimizer, 3)
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

        # The resumed run: fresh objects; rank 0 loads what it saved.
        torch.manual_seed(1000 + rank)
        model, optimizer = build(kind)
        if rank == 0:
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        check(f"{kind}-identical-after-resume", lambda m=model, o=optimizer: identical(m, o))
        check(
            f"{kind}-parameters-are-the-checkpoints",
            lambda m=model, c=checkpoint: all(
                torch.equal(p, c["model"][name]) for name, p in m.named_parameters()
            ),
        )
        train(model, optimizer, 2)
        check(f"{kind}-identical-after-training-on", lambda m=model, o=optimizer: identical(m, o))
        check(f"{kind}-check-agreement-passes", lambda m=model, o=optimizer: _agrees(m, o))

    # Horovod's own state-creating step (parameters not restored) on ranks other than 0:
    # check_agreement names the first parameter it moved, on every rank.
    torch.manual_seed(0)
    model, optimizer = build("sgd")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if rank != 0:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        torch.optim.SGD.step(optimizer)
    try:
        rpt.check_agreement(model, where="after resuming")
        error = None
    except rpt.RanksDisagreeError as caught:
        error = caught
    others = list(range(1, hvd.size()))
    checks["drift-named"] = (
        error is not None
        and error.tensor == "conv.weight"
        and error.groups == [[0], others]
        and "after resuming on 'conv.weight'" in str(error)
        and f"rank 0 holds value A; {'rank 1 holds' if len(others) == 1 else 'ranks 1, 2 hold'}"
        in str(error)
    )
    if error is not None:
        print(f"rank {rank}: {error}", file=sys.stderr)
    (outdir / f"resume-{rank}.json").write_text(json.dumps(checks))


def _agrees(model: Net, optimizer: torch.optim.Optimizer) -> bool:
    rpt.check_agreement(model, optimizer, where="after resuming")
    return True


if __name__ == "__main__":
    main(Path(sys.argv[1]))
