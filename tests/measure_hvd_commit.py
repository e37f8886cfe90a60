"""Measure what one ``hvd.elastic.TorchState.commit()`` costs, in milliseconds.

    python tests/measure_hvd_commit.py [--commits 20]

One process (a world of one), SGD with momentum (so the optimizer state is as large as the
model), after one step. For a ResNet-18-sized model (11.7 M parameters, built here: no
torchvision needed) and a small MNIST convnet, the median over `--commits` commits of: the
commit in memory only (no elastic job: ``save()`` serialises the state) and the commit
written to disk too (``RINGPLUG_ELASTIC_DIR`` set: what rank 0 of each host does under
``ringrun --max-restarts``). Not a test: it only prints one row per model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import ringplug.horovod.torch as hvd


def block(channels_in: int, channels: int, stride: int) -> torch.nn.Module:
    layers = [
        torch.nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False),
        torch.nn.BatchNorm2d(channels),
        torch.nn.ReLU(),
        torch.nn.Conv2d(channels, channels, 3, 1, 1, bias=False),
        torch.nn.BatchNorm2d(channels),
    ]
    if stride != 1 or channels_in != channels:
        layers += [torch.nn.Conv2d(channels_in, channels, 1, stride, bias=False)]
        layers += [torch.nn.BatchNorm2d(channels)]
    return torch.nn.Sequential(*layers)


def resnet18_sized() -> torch.nn.Module:
    """ResNet-18's layers and parameters (11.69 M), not its forward (no skip connections:
    only the state's size matters here)."""
    layers = [torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64)]
    channels_in = 64
    for channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [block(channels_in, channels, stride), block(channels, channels, 1)]
        channels_in = channels
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(512, 1000)]
    return torch.nn.Sequential(*layers)


def mnist_net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 10, 5),
        torch.nn.MaxPool2d(2),
        torch.nn.ReLU(),
        torch.nn.Conv2d(10, 20, 5),
        torch.nn.MaxPool2d(2),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(320, 50),
        torch.nn.ReLU(),
        torch.nn.Linear(50, 10),
    )


def median_ms(state: hvd.elastic.TorchState, commits: int) -> float:
    times = []
    for _ in range(commits):
        start = time.perf_counter()
        state.commit()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commits", type=int, default=20)
    commits = parser.parse_args().commits
    hvd.init()
    print(f"{'model':<16}{'parameters':>12}{'commit bytes':>14}{'memory ms':>11}{'disk ms':>9}")
    for name, model in (("resnet18-sized", resnet18_sized()), ("mnist convnet", mnist_net())):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for parameter in model.parameters():  # a step, so the momentum buffers exist
            parameter.grad = torch.full_like(parameter, 1e-3)
        optimizer.step()
        state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
        os.environ.pop("RINGPLUG_ELASTIC_DIR", None)
        os.environ.pop("RINGPLUG_JOB_ID", None)
        state._store = None
        memory = median_ms(state, commits)
        with tempfile.TemporaryDirectory() as folder:
            os.environ["RINGPLUG_ELASTIC_DIR"] = folder
            state._store = None
            disk = median_ms(state, commits)
            size = sum(p.stat().st_size for p in os.scandir(folder))
        count = sum(p.numel() for p in model.parameters())
        print(f"{name:<16}{count:>12,}{size:>14,}{memory:>11.1f}{disk:>9.1f}")


if __name__ == "__main__":
    main()
