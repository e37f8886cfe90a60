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

import numpy as np
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


def make_model(variant: str = "plain") -> torch.nn.Module:
    torch.manual_seed(42)
    if variant == "tiny":  # one parameter tensor: every rank but one owns nothing
        return torch.nn.Linear(8, 4, bias=False)
    # "wide": 6.3 MB of gradients in one bucket, above the size from which the engine
    # reduces with its ring (1 MiB) rather than MPI's Allreduce.
    width = 512 if variant == "wide" else 32
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, width)]
    for _ in range(6):
        layers += [torch.nn.Tanh(), torch.nn.Linear(width, width)]
    layers += [torch.nn.Tanh(), torch.nn.Linear(width, 4)]
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


def grad_storage_bytes(model: torch.nn.Module) -> int:
    """The bytes of the memory the gradients keep alive (a view keeps all of its storage)."""
    storages = {
        p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
        for p in model.parameters()
        if p.grad is not None
    }
    return sum(storages.values())


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(
    optimizer_name: str,
    zero: int | None,
    variant: str = "plain",
    steps: range = range(STEPS),
    model: torch.nn.Module | None = None,
    load: dict | None = None,
    layout: str = "whole",
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """``zero=None``: one plain process on the whole batch; else DistributedOptimizer(zero)."""
    model = model or make_model(variant)
    rank, size = ringplug.rank(), ringplug.size()
    passes = 2 if variant == "accumulate" else 1
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    if zero is not None:
        optimizer = rpt.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            backward_passes_per_step=passes,
            zero=zero,
            zero_layout=layout,
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
    facts["grad_storage_bytes"] = grad_storage_bytes(model)
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
    *((name, zero, "plain", "whole") for name in OPTIMIZERS for zero in (1, 2)),
    *(("adamw", zero, "clip", "whole") for zero in (1, 2)),
    *(("adam", zero, "accumulate", "whole") for zero in (1, 2)),
    *(("adam", zero, "tiny", "whole") for zero in (1, 2)),
    *(("sgd", zero, "wide", "whole") for zero in (1, 2)),
    # zero_layout="flat": each rank steps an equal slice of every bucket.
    *(("adam", zero, "plain", "flat") for zero in (1, 2)),
    ("sgd", 2, "plain", "flat"),
    ("adamw", 2, "clip", "flat"),
    ("adam", 2, "accumulate", "flat"),
    ("adam", 2, "tiny", "flat"),
    ("sgd", 2, "wide", "flat"),
]


def cases(outdir: Path) -> dict:
    report: dict = {}
    references: dict = {}
    for name, zero, variant, layout in CASES:
        if (name, variant) not in references:
            references[(name, variant)] = train(name, 0, variant)
        reference, plain_optimizer, plain = references[(name, variant)]
        model, optimizer, facts = train(name, zero, variant, layout=layout)
        del facts["scheduler"]
        key = f"{name}-{variant}-zero{zero}" + ("-flat" if layout == "flat" else "")
        report[key] = {
            **compare(model, reference),
            **facts,
            "unsharded_state_bytes": plain["state_bytes"],
            "unsharded_grad_bytes": plain["grad_bytes"],
            "unsharded_clipped": plain["clipped"],
        }
        optimizer.detach_hooks()
        plain_optimizer.detach_hooks()
        if (name, variant, zero, layout) == ("adam", "plain", 2, "whole"):
            consolidate(outdir, model, optimizer, plain_optimizer, report)
        if (name, variant, zero, layout) == ("adam", "plain", 2, "flat"):
            report["flat_state"] = flat_state(model, optimizer, plain_optimizer)
    return report


def same_state(mine: dict, expected: dict) -> bool:
    """Two optimizer state dicts' states equal (to 1e-6), each parameter's every value."""
    return sorted(mine) == sorted(expected) and all(
        torch.allclose(value, expected[index][key], rtol=1e-6, atol=1e-9)
        for index, state in mine.items()
        for key, value in state.items()
    )


def flat_state(model, optimizer, plain_optimizer) -> dict:
    """The flat layout's state: consolidated on rank 0 it is zero=0's (and loads into a
    plain Adam); zero=0's whole dict loads into a fresh flat optimizer as the same pieces;
    a sharded dict round-trips."""
    unsharded = plain_optimizer.state_dict()  # zero=0: the whole state on every rank
    optimizer.consolidate_state_dict(to=0)
    consolidated = True
    if ringplug.rank() == 0:
        whole = optimizer.state_dict()
        consolidated = same_state(whole["state"], unsharded["state"])
        consolidated &= whole["param_groups"] == unsharded["param_groups"]
        torch.optim.Adam(make_model().parameters(), lr=0.01).load_state_dict(whole)
    pieces = [(x.index, x.start, x.stop) for x in optimizer._ringplug_pieces]
    again = rpt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), zero=2, zero_layout="flat"
    )
    again.load_state_dict(unsharded)
    loads_whole = len(again.state) == len(optimizer.state) == len(pieces) and all(
        torch.allclose(again.state[b.tensor][key], optimizer.state[a.tensor][key], rtol=1e-6)
        for a, b in zip(optimizer._ringplug_pieces, again._ringplug_pieces, strict=True)
        for key in ("exp_avg", "exp_avg_sq", "step")
    )
    shard = optimizer.sharded_state_dict()
    again.load_sharded_state_dict(shard)
    round_trip = all(
        torch.equal(again.state[b.tensor][key], optimizer.state[a.tensor][key])
        for a, b in zip(optimizer._ringplug_pieces, again._ringplug_pieces, strict=True)
        for key in ("exp_avg", "exp_avg_sq", "step")
    )
    again.detach_hooks()
    try:  # a whole-layout shard is refused, saying why
        rpt.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.01), zero=2
        ).load_sharded_state_dict(shard)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "consolidated_equals_unsharded": consolidated,
        "loads_whole_state": loads_whole,
        "sharded_round_trip": round_trip,
        "whole_layout_refuses_flat_shard": "zero_layout='flat'" in refused,
    }


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


def in_place_collectives() -> dict:
    """The core's reducescatter_in_place then allgather_in_place, over several arrays cut
    into blocks of any length (one of them empty), small (MPI's Allreduce) and large (the
    ring): each rank's block ends equal to its block of the whole reduction, then every
    rank's arrays to the whole reduction."""
    from ringplug.core.collectives import allgather_in_place_async, reducescatter_in_place_async

    rank, size = ringplug.rank(), ringplug.size()
    results = {}
    for label, scale in (("small", 1), ("ring", 20_000)):
        lengths = [5 * scale, 7 * scale, 3 * scale]
        total = sum(lengths)
        counts = (
            [0, total // 3, total - total // 3] if size == 3 else [total // 4, total - total // 4]
        )
        generator = torch.Generator().manual_seed(rank)
        arrays = [torch.randn(n, generator=generator).numpy() for n in lengths]
        everyone = rpt.allgather(torch.from_numpy(np.concatenate(arrays)).unsqueeze(0))
        expected = everyone.sum(0) * 0.5 / size  # Average with a prescale of 0.5
        handle = reducescatter_in_place_async(
            arrays, counts, "average", prescale_factor=0.5, name=f"in_place.{label}"
        )
        returned = handle.wait()
        got = torch.from_numpy(np.concatenate(arrays))
        lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
        scattered = torch.allclose(got[lo:hi], expected[lo:hi], rtol=1e-5, atol=1e-6)
        gathered = allgather_in_place_async(arrays, counts, name=f"in_place.{label}.gather").wait()
        everywhere = torch.from_numpy(np.concatenate(arrays))
        results[label] = {
            "reducescatter": returned is None and bool(scattered),
            "allgather": gathered is None
            and bool(torch.allclose(everywhere, expected, rtol=1e-5, atol=1e-6)),
        }
    return results


def refusals() -> dict:
    model = make_model()
    try:
        rpt.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), zero=1)
    except ValueError as error:
        found = {"lbfgs_refused": str(error)}
    else:
        found = {"lbfgs_refused": None}
    # Broadcasting a sharded optimizer's state: refused on every rank, none left waiting.
    import ringplug.horovod.torch as hvd

    for label, broadcast in (("core", rpt.broadcast_optimizer_state),
                             ("horovod", hvd.broadcast_optimizer_state)):  # fmt: skip
        sharded = rpt.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(), zero=1
        )
        try:
            broadcast(sharded, root_rank=0)
            found[f"broadcast_refused_{label}"] = None
        except ValueError as error:
            found[f"broadcast_refused_{label}"] = str(error)
    return found


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
    report = {**cases(outdir), **refusals(), "in_place": in_place_collectives()}
    if ringplug.size() == 3:
        save_for_resume(outdir)
    if checkpoint is not None:
        report["resumed"] = resume(checkpoint)
    report["torch_zero_redundancy"] = torch_zero_redundancy()
    (outdir / f"zero-{ringplug.rank()}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
