"""A rank of tests/test_autotune_ranks.py: train a small model with ringplug.torch's
DistributedOptimizer, and report what the engine's autotuner applied and when.

Usage: autotune.py OUTDIR [FUSION_BYTES CYCLE_SECONDS]. With a setting, the ranks start
tuning afresh from it after the first step (`autotune.tune_from`; ringrun refuses a fixed
setting with --autotune). Each rank writes OUTDIR/rank-R.json: the final parameters, the
(cycle, fusion threshold, cycle time, allreduce bands) of each setting its tuner applied,
and per step the engine's setting at its start and end (fusion threshold, cycle time,
allreduce bands as [algorithm, start, end] lists: none for the table's choice at every
size), the algorithm the transport then takes for an allreduce of each of `PROBES` bytes,
and the collectives the step ran. Whether autotune is on, and its budget, come from the
environment (ringrun's --autotune flags), as every adapter reads them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import ringplug
import ringplug.torch as rpt
from ringplug.core import autotune, runtime
from ringplug.core.algorithms import ALLREDUCE

STEPS = 70
# Small buckets: each step submits a dozen bucket allreduces, so the fusion threshold
# decides how many collectives a step runs.
BUCKET_BYTES = 16 << 10
# Allreduce sizes whose algorithm each step reports: a bucket, the step's buffers fused
# whole (about 100 KiB), sizes no buffer has.
PROBES = (4 << 10, BUCKET_BYTES, 100_000, 1 << 20, 8 << 20)
# The longest a step waits for the engine thread's cycle to end before it reads its setting
# (a cycle takes milliseconds; the job's own limit is 180 s).
TURN_TIMEOUT_S = 60


def bands_json(bands) -> list[list]:
    return [[band.algorithm, band.start, band.end] for band in bands]


def main(outdir: Path, start: list[str]) -> None:
    rpt.init()
    rank = rpt.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.Tanh(),
        torch.nn.Linear(128, 128),
        torch.nn.Tanh(),
        torch.nn.Linear(128, 8),
    )
    optimizer = rpt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters(),
        bucket_bytes=BUCKET_BYTES,
    )
    engine = runtime.engine()
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    steps = []

    def setting() -> tuple[int, float, list[list]]:
        return (
            engine.settings.fusion_threshold,
            engine.settings.cycle_time,
            bands_json(engine.tuned_bands),
        )

    for step in range(STEPS):
        if step == 1 and start:
            ringplug.barrier()  # nothing in flight on any rank
            autotune.tune_from(engine, int(start[0]), float(start[1]))
        # The setting this step runs with. The cycle that completed the last step may still
        # be ending on the engine thread: the tuner applies the next setting at a cycle's
        # end, after its handles completed, so a rank whose optimizer step returned at once
        # could read the setting before its own engine applied it. Read it holding the turn
        # that the thread runs cycles with: that cycle has ended, and no other begins until
        # this step submits.
        if not engine.scheduler.turn.acquire(timeout=TURN_TIMEOUT_S):
            raise RuntimeError(
                f"rank {rank}, before step {step}: the engine thread held its turn for "
                f"{TURN_TIMEOUT_S} s (the cycle that completed step {step - 1} never ended)"
            )
        try:
            before = setting()
            # What the transport takes for each probe now, once its table is made (making it
            # is collective: the engine thread's).
            table = engine.transport._algorithms
            taken = [table.choose(ALLREDUCE, n, True) for n in PROBES] if table is not None else []
        finally:
            engine.scheduler.turn.release()
        collectives = engine.collectives_run
        inputs = torch.randn(32, 64, generator=data)
        target = torch.randn(32, 8, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), target).backward()
        optimizer.step()
        steps.append(
            {
                "before": before,
                "after": setting(),
                "taken": taken,
                "collectives": engine.collectives_run - collectives,
            }
        )
    tuner = engine.tuner
    report = {
        "tuned": tuner is not None,
        "applied": [
            (cycle, c.fusion_threshold, c.cycle_time_ms, bands_json(c.bands))
            for cycle, c in tuner.applied
        ]
        if tuner
        else [],
        "done": bool(tuner and tuner.done),
        "tuning_steps": tuner.steps if tuner else 0,
        "final": setting(),
        "offered": list(tuner.search.algorithms) if tuner and tuner.search else [],
        "probes": PROBES,
        "steps": steps,
        "parameters": [p.detach().double().reshape(-1).tolist() for p in model.parameters()],
    }
    (outdir / f"rank-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
