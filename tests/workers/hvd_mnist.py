"""An MNIST-style training script as Horovod users write them, using only ``hvd.*`` names,
on synthetic 28x28 digits-like data. ``python hvd_mnist.py OUTDIR`` writes
OUTDIR/mnist-<rank>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ringplug.horovod.torch as hvd


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 5)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 12 * 12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return F.log_softmax(self.fc(x.flatten(1)), dim=1)


def synthetic(count: int, seed: int) -> TensorDataset:
    """Class k is a bright square at a k-dependent place, plus noise."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=generator)
    images = torch.rand(count, 1, 28, 28, generator=generator) * 0.3
    for i, k in enumerate(labels.tolist()):
        row, col = 4 + (k // 5) * 12, 2 + (k % 5) * 5
        images[i, 0, row : row + 6, col : col + 4] += 1.0
    return TensorDataset(images, labels)


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main(outdir: Path) -> None:
    hvd.init()
    torch.manual_seed(hvd.rank())  # a different initialization per rank on purpose
    torch.set_num_threads(1)
    train = synthetic(512, seed=0)
    sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(train, batch_size=16, sampler=sampler)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02 * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.none,
        backward_passes_per_step=2,
        op=hvd.Average,
    )
    losses = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        model.train()
        for step, (data, target) in enumerate(loader):
            if step % 2 == 0:
                optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()  # two passes accumulate before one reduction (passes_per_step)
            if step % 2 == 1:
                optimizer.synchronize()  # averaged gradients, to clip ...
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                with optimizer.skip_synchronize():  # ... then step without syncing again
                    optimizer.step()
        losses.append(metric_average(loss.item(), "avg_loss"))

    test = synthetic(200, seed=1)
    test_sampler = DistributedSampler(test, num_replicas=hvd.size(), rank=hvd.rank())
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in DataLoader(test, batch_size=50, sampler=test_sampler):
            correct += int((model(data).argmax(1) == target).sum())
    accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
    # Parameters (BatchNorm's running statistics stay per rank, as in Horovod).
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0))
    report = {
        "losses": losses,
        "accuracy": accuracy,
        "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
    }
    (outdir / f"mnist-{hvd.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
