"""Measure what ``ringplug.torch.check_agreement`` costs, against a training step and a
checkpoint write of the same model, in milliseconds.

    ringrun -np 2 python tests/measure_agreement.py [--repeats 10] [--device cpu|cuda]

Two models, SGD with momentum (so the optimizer state is as large as the model, and both
are compared): the MLP of ``ringplug-bench lightning`` (1024 -> 4096 -> 4096 -> 10, 21 M
parameters; its step is forward, backward and the averaged update of a batch of 32 on each
rank) and a ResNet-50-sized set of tensors (25.6 M parameters in 161 tensors, built here:
no torchvision needed; no step). Rank 0 prints one row per model: the medians over
`--repeats` of the check (sums where the tensors live, one 16-byte allreduce), of the sums
alone, of rank 0's ``torch.save`` of the model's and optimizer's state, and of a step.
Not a test: it only prints.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable

import torch

import ringplug.torch as rpt
from ringplug.bench.frameworks.lightning_job import layers
from ringplug.torch.agreement import checksums, named_state


def resnet50_sized() -> torch.nn.Module:
    """ResNet-50's parameter tensors (25.56 M in 161), not its forward."""
    modules: list[torch.nn.Module] = [
        torch.nn.Conv2d(3, 64, 7, bias=False),
        torch.nn.BatchNorm2d(64),
    ]
    channels_in = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for index in range(blocks):
            out = width * 4
            modules += [
                torch.nn.Conv2d(channels_in, width, 1, bias=False),
                torch.nn.BatchNorm2d(width),
                torch.nn.Conv2d(width, width, 3, bias=False),
                torch.nn.BatchNorm2d(width),
                torch.nn.Conv2d(width, out, 1, bias=False),
                torch.nn.BatchNorm2d(out),
            ]
            if index == 0:
                modules += [
                    torch.nn.Conv2d(channels_in, out, 1, bias=False),
                    torch.nn.BatchNorm2d(out),
                ]
            channels_in = out
    modules.append(torch.nn.Linear(2048, 1000))
    return torch.nn.Sequential(*modules)


def median_ms(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rpt.init()
    device = torch.device(args.device)
    if rpt.rank() == 0:
        print(
            f"# {rpt.size()} ranks, {torch.get_num_threads()} torch threads a rank, "
            f"device {device}; medians of {args.repeats}, ms"
        )
        print(
            f"{'model':<16}{'parameters':>12}{'MB compared':>13}{'check':>9}{'sums':>8}"
            f"{'torch.save':>12}{'step':>9}{'check/step':>12}"
        )
    for name, model in (("bench MLP", layers(4096)), ("resnet50-sized", resnet50_sized())):
        measure(name, model.to(device), args.repeats, device, step=name == "bench MLP")


def measure(
    name: str, model: torch.nn.Module, repeats: int, device: torch.device, step: bool
) -> None:
    torch.manual_seed(0)
    for p in model.parameters():  # the same start on every rank
        torch.nn.init.normal_(p, std=0.01)
    optimizer = rpt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    step_ms = float("nan")
    if step:
        x = torch.randn(32, 1024, device=device)
        y = torch.randint(0, 10, (32,), device=device)

        def train_step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        step_ms = median_ms(train_step, repeats, device)
    else:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        torch.optim.SGD.step(optimizer)  # the momentum buffers, without a reduction
    labels = {id(p): n for n, p in model.named_parameters()}
    tensors = [*model.parameters()] + [t for _, t in named_state(optimizer, labels)]
    compared = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    check_ms = median_ms(lambda: rpt.check_agreement(model, optimizer), repeats, device)
    sums_ms = median_ms(lambda: checksums(tensors), repeats, device)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    save_ms = median_ms(lambda: torch.save(state, io.BytesIO()), repeats, device)
    if rpt.rank() == 0:
        count = sum(p.numel() for p in model.parameters())
        print(
            f"{name:<16}{count:>12,}{compared:>13.0f}{check_ms:>9.1f}{sums_ms:>8.1f}"
            f"{save_ms:>12.1f}{step_ms:>9.1f}{check_ms / step_ms:>12.1%}"
        )


if __name__ == "__main__":
    main()
