"""Multi-rank worker: DistributedOptimizer trains like one process on the union of batches.

``python torch_optimizer.py SCENARIO[,SCENARIO...] OUTDIR``: the scenarios one after the
other in the same ranks, each writing OUTDIR/SCENARIO-RANK.json. Every rank also trains a
plain reference model on the whole global batch (1 process x batch 2B), locally, and
compares.

Scenario ``buffers`` instead trains a BatchNorm model with rank 1's inputs shifted by +3, with
``DistributedOptimizer(module=model)`` and without ``module``, and records how far the ranks'
running means drift from rank 0's against the bound DDP keeps (momentum x the difference of
the ranks' batch means).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import ringplug
import ringplug.torch as rpt
from ringplug.torch.state import broadcast_buffers

STEPS, PER_RANK = 5, 8


def make_model(unused_branch: bool = False) -> torch.nn.Module:
    torch.manual_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if unused_branch:
        model.unused = torch.nn.Linear(4, 4)  # never called in forward
    return model


def batches(size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    rows = PER_RANK * size
    return [
        (torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator))
        for _ in range(STEPS)
    ]


def train(scenario: str, rank: int, size: int, distributed: bool) -> torch.nn.Module:
    model = make_model(unused_branch=scenario == "unused")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    passes = 2 if scenario == "accumulate" else 1
    if distributed:
        optimizer = rpt.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            backward_passes_per_step=passes,
            compression=rpt.Compression.fp16 if scenario == "fp16" else rpt.Compression.none,
            gradient_predivide_factor=2.0 if scenario == "predivide" else 1.0,
        )
    for inputs, targets in batches(size):
        if distributed:
            inputs = inputs[rank * PER_RANK : (rank + 1) * PER_RANK]
            targets = targets[rank * PER_RANK : (rank + 1) * PER_RANK]
        optimizer.zero_grad()
        chunks = passes if distributed else 1
        for x, y in zip(inputs.chunk(chunks), targets.chunk(chunks), strict=True):
            loss = torch.nn.functional.mse_loss(model(x), y) / chunks
            loss.backward()
        if scenario == "clip":
            if distributed:
                optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            if distributed:
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        else:
            optimizer.step()
    return model


def main(scenario: str, outdir: Path) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    engine = ringplug.core.runtime.engine()
    before = engine.collectives_run
    distributed = train(scenario, rank, size, True)
    collectives = engine.collectives_run - before
    reference = train(scenario, rank, size, False)
    flat = torch.cat([p.detach().reshape(-1) for p in distributed.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    everyone = rpt.allgather(flat.unsqueeze(0))
    tolerance = 1e-2 if scenario == "fp16" else 1e-5
    report = {
        "matches_one_process": bool(torch.allclose(flat, expected, atol=tolerance, rtol=0)),
        "max_difference": float((flat - expected).abs().max()),
        "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
        "collectives": collectives,
        # CPU training must not start the GPU plane or load NCCL (nor need it installed).
        "touched_nccl": engine._gpu is not None
        or getattr(sys.modules.get("ringplug.core.gpu.nccl"), "_loaded", None) is not None
        or "libnccl" in Path("/proc/self/maps").read_text(),
    }
    (outdir / f"{scenario}-{rank}.json").write_text(json.dumps(report))


def buffers(outdir: Path) -> None:
    ringplug.init()
    rank = ringplug.rank()
    report = {}
    for label, give_module in (("kept", True), ("apart", False)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        optimizer = rpt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), module=model if give_module else None
        )
        generator = torch.Generator().manual_seed(rank)
        excess = largest = 0.0
        for _ in range(12):
            x = torch.randn(8, 4, generator=generator) + 3.0 * (rank == 1)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), torch.zeros(8, 1)).backward()
            optimizer.step()
            means = rpt.allgather(x.mean(0, keepdim=True))
            running = rpt.allgather(model[0].running_mean.clone().unsqueeze(0))
            gap = (running - running[0]).abs()
            bound = model[0].momentum * (means - means[0]).abs()
            excess = max(excess, float((gap - bound).max()))
            largest = max(largest, float(gap.max()))
        optimizer.detach_hooks()
        report[label] = {"worst_excess_over_ddp_bound": excess, "largest_gap": largest}
    # Buffers of several dtypes and layouts travel as one broadcast of bytes, from rank 1.
    mixed = [
        torch.full((3,), float(rank)),
        torch.tensor(rank + 10),
        torch.full((2, 3), rank + 1.0).t(),  # not contiguous
        torch.tensor([rank == 1]),
        torch.full((4,), rank, dtype=torch.float64),
    ]
    broadcast_buffers(mixed, root_rank=1)
    report["mixed_from_rank_1"] = [t.tolist() for t in mixed]
    (outdir / f"buffers-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    for name in sys.argv[1].split(","):
        if name == "buffers":
            buffers(Path(sys.argv[2]))
        else:
            main(name, Path(sys.argv[2]))
