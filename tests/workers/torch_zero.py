"""Multi-rank worker: sharded optimizer state (``DistributedOptimizer(zero=1/2)``).

``python torch_zero.py OUTDIR [CHECKPOINT]``: every scenario in turn in the same ranks, each
rank writing OUTDIR/zero-RANK.json. Each case trains the same model on the same fixed global
batch (split over the ranks) sharded and unsharded (``zero=0``), and reports the largest
weight difference relative to the largest weight, the optimizer-state and gradient bytes
this rank holds, and whether the ranks ended identical.

With 3 ranks, rank 0 also writes OUTDIR/consolidated.pt (a consolidated optimizer state dict
and its unsharded twin) and OUTDIR/resume.pt (a checkpoint after RESUME_AT steps); given
CHECKPOINT (such a resume.pt), the ranks resume from it and train on to STEPS, against one
plain process that trained STEPS steps on the whole batch. Last, torch's own
ZeroRedundancyOptimizer trains over DDP on the ``ringplug`` backend against one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ringplug
import ringplug.torch as rpt

STEPS, RESUME_AT, GLOBAL_BATCH, MAX_NORM = 20, 10, 12, 0.05
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def make_model(tiny: bool = False) -> torch.nn.Module:
    torch.manual_seed(42)
    if tiny:  # one parameter tensor: every rank but one owns nothing
        return torch.nn.Linear(8, 4, bias=False)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 32)]
    for _ in range(6):
        layers += [torch.nn.Tanh(), torch.nn.Linear(32, 32)]
    layers += [torch.nn.Tanh(), torch.nn.Linear(32, 4)]
    return torch.nn.Sequential(*layers)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(GLOBAL_BATCH, 8, generator=generator),
            torch.randn(GLOBAL_BATCH, 4, generator=generator),
        )
        for _ in range(STEPS)
    ]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def grad_bytes(model: torch.nn.Module) -> int:
    return sum(
        p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
    )


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(
    optimizer_name: str,
    zero: int | None,
    variant: str = "plain",
    steps: range = range(STEPS),
    model: torch.nn.Module | None = None,
    load: dict | None = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """``zero=None``: one plain process on the whole batch; else DistributedOptimizer(zero)."""
    model = model or make_model(tiny=variant == "tiny")
    rank, size = ringplug.rank(), ringplug.size()
    passes = 2 if variant == "accumulate" else 1
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    if zero is not None:
        optimizer = rpt.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            backward_passes_per_step=passes,
            zero=zero,
        )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    if load is not None:  # a checkpoint: {"optimizer": ..., "scheduler": ...}
        optimizer.load_state_dict(load["optimizer"])
        scheduler.load_state_dict(load["scheduler"])
    facts = {"clipped": False}
    data = batches()
    for step in steps:
        inputs, targets = data[step]
        if zero is not None:
            share = GLOBAL_BATCH // size
            inputs = inputs[rank * share : (rank + 1) * share]
            targets = targets[rank * share : (rank + 1) * share]
        optimizer.zero_grad()
        chunks = passes if zero is not None else 1
        for x, y in zip(inputs.chunk(chunks), targets.chunk(chunks), strict=True):
            (torch.nn.functional.mse_loss(model(x), y) / chunks).backward()
        if variant == "clip":
            if zero:
                norm = optimizer.clip_grad_norm_(MAX_NORM)
            else:
                if zero is not None:
                    optimizer.synchronize()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            facts["clipped"] |= bool(norm > MAX_NORM)
            if zero == 0:
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        else:
            optimizer.step()
        scheduler.step()
    facts["state_bytes"] = state_bytes(optimizer)
    facts["grad_bytes"] = grad_bytes(model)
    facts["scheduler"] = scheduler.state_dict()
    return model, optimizer, facts


def compare(model: torch.nn.Module, reference: torch.nn.Module) -> dict:
    mine, expected = flat(model), flat(reference)
    everyone = rpt.allgather(mine.unsqueeze(0))
    return {
        "relative_difference": float((mine - expected).abs().max() / expected.abs().max()),
        "ranks_identical": all(torch.equal(row, everyone[0]) for row in everyone),
    }


CASES = [
    *((name, zero, "plain") for name in OPTIMIZERS for zero in (1, 2)),
    *(("adamw", zero, "clip") for zero in (1, 2)),
    *(("adam", zero, "accumulate") for zero in (1, 2)),
    *(("adam", zero, "tiny") for zero in (1, 2)),
]


def cases(outdir: Path) -> dict:
    report: dict = {}
    references: dict = {}
    for name, zero, variant in CASES:
        if (name, variant) not in references:
            references[(name, variant)] = train(name, 0, variant)
        reference, plain_optimizer, plain = references[(name, variant)]
        model, optimizer, facts = train(name, zero, variant)
        del facts["scheduler"]
        report[f"{name}-{variant}-zero{zero}"] = {
            **compare(model, reference),
            **facts,
            "unsharded_state_bytes": plain["state_bytes"],
            "unsharded_grad_bytes": plain["grad_bytes"],
            "unsharded_clipped": plain["clipped"],
        }
        optimizer.detach_hooks()
        plain_optimizer.detach_hooks()
        if (name, variant, zero) == ("adam", "plain", 2):
            consolidate(outdir, model, optimizer, plain_optimizer, report)
    return report


def consolidate(outdir: Path, model, optimizer, plain_optimizer, report: dict) -> None:
    """The consolidated dict on rank 0 (for the test to load into a plain Adam), and a
    sharded round trip on every rank."""
    optimizer.consolidate_state_dict(to=0)
    if ringplug.rank() == 0:
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "unsharded": plain_optimizer.state_dict(),
                "model": model.state_dict(),
            },
            outdir / f"consolidated-{ringplug.size()}.pt",
        )
    shard = optimizer.sharded_state_dict()
    again = rpt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), zero=2)
    again.load_sharded_state_dict(shard)
    report["sharded_round_trip"] = all(
        torch.equal(again.state[p][key], optimizer.state[p][key])
        for p in optimizer.state
        for key in ("exp_avg", "exp_avg_sq")
    ) and len(again.state) == len(optimizer.state)
    again.detach_hooks()


def save_for_resume(outdir: Path) -> None:
    model, optimizer, facts = train("adamw", 2, steps=range(RESUME_AT))
    optimizer.consolidate_state_dict(to=0)
    if ringplug.rank() == 0:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": facts["scheduler"],
            },
            outdir / "resume.pt",
        )
    optimizer.detach_hooks()


def resume(checkpoint: Path) -> dict:
    saved = torch.load(checkpoint)
    model = make_model()
    model.load_state_dict(saved["model"])
    model, optimizer, _ = train("adamw", 2, steps=range(RESUME_AT, STEPS), model=model, load=saved)
    optimizer.detach_hooks()
    reference, _, _ = train("adamw", None)
    return compare(model, reference)


def refusals() -> dict:
    model = make_model()
    try:
        rpt.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), zero=1)
    except ValueError as error:
        return {"lbfgs_refused": str(error)}
    return {"lbfgs_refused": None}


def torch_zero_redundancy() -> dict:
    """torch's ZeroRedundancyOptimizer, over DDP, on the ringplug backend."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("ringplug")
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    rank, size = ringplug.rank(), ringplug.size()
    share = GLOBAL_BATCH // size
    for inputs, targets in batches():
        optimizer.zero_grad()
        x, y = inputs[rank * share : (rank + 1) * share], targets[rank * share : (rank + 1) * share]
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    optimizer.consolidate_state_dict(to=0)
    loads = True
    if rank == 0:
        plain = torch.optim.Adam(make_model().parameters(), lr=0.01)
        plain.load_state_dict(optimizer.state_dict())
        loads = len(plain.state) == len(list(model.parameters()))
    reference, _, _ = train("adam", None)
    result = {**compare(model.module, reference), "consolidated_loads": loads}
    dist.destroy_process_group()
    return result


def main(outdir: Path, checkpoint: Path | None) -> None:
    ringplug.init()
    report = {**cases(outdir), **refusals()}
    if ringplug.size() == 3:
        save_for_resume(outdir)
    if checkpoint is not None:
        report["resumed"] = resume(checkpoint)
    report["torch_zero_redundancy"] = torch_zero_redundancy()
    (outdir / f"zero-{ringplug.rank()}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
