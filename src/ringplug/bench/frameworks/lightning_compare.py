"""`ringplug-bench lightning`: RingStrategy against Lightning's DDPStrategy (gloo) on CPU.

It starts every job itself, in alternating pairs so that drift on a shared machine hits
both sides alike: 2 ranks with RingStrategy (under ringrun) against 2 ranks of DDP (which
Lightning starts), and 1 rank with RingStrategy against plain Lightning (the overhead when
nothing is communicated), and a tiny MLP on 2 ranks where each step's fixed costs (the
strategy's own collectives, Lightning's per-batch work) dominate: there it reports the
median time per step of each side. Every job uses one torch thread per rank
(OMP_NUM_THREADS=1), per-rank batch 32 and synthetic data. Reports medians of the pairs'
ratios.

With ``--fabric-buffers`` it measures what keeping rank 0's buffers costs under Fabric: the
same MLPs with a BatchNorm after each hidden layer, in a Fabric loop on 2 ranks with
`RingFabricStrategy`, ``broadcast_buffers`` on against off, in alternating pairs.

With ``--diagnose`` it measures instead what the step-time breakdown costs per step: jobs
of RingStrategy on 2 ranks (the MLP and the tiny MLP) that switch it on and off every few
steps, comparing the median step time of the two halves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..common import alternating_pairs, write_job_json

JOB = str(Path(__file__).with_name("lightning_job.py"))
TINY = "-tiny"  # an impl with this suffix trains the tiny MLP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=5, help="alternating pairs per comparison")
    parser.add_argument("--steps", type=int, default=20, help="training steps per job")
    parser.add_argument(
        "--hidden", type=int, default=4096, help="MLP width (4096: about 21 M parameters)"
    )
    parser.add_argument(
        "--tiny-hidden", type=int, default=8, help="width of the tiny MLP (8: about 8 k parameters)"
    )
    parser.add_argument(
        "--tiny-steps", type=int, default=200, help="training steps per tiny-model job"
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="instead: the cost of the step-time breakdown per step (on and "
        "off in turns within each 2-rank job)",
    )
    parser.add_argument(
        "--flight-cost",
        action="store_true",
        help="instead: RingStrategy with its flight record against RINGPLUG_FLIGHT_RECORD=0, "
        "alternating, on the MLP and the tiny MLP",
    )
    parser.add_argument(
        "--fabric-buffers",
        action="store_true",
        help="instead: RingFabricStrategy with broadcast_buffers on against off, alternating, "
        "on the MLP and the tiny MLP with BatchNorm",
    )
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")


NO_FLIGHT = "-noflight"  # an impl with this suffix runs with RINGPLUG_FLIGHT_RECORD=0


def _job(impl: str, ranks: int, args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / f"{impl}-{ranks}.json"
    tiny = impl.endswith(TINY)
    impl = impl.removesuffix(TINY)
    steps, hidden = (args.tiny_steps, args.tiny_hidden) if tiny else (args.steps, args.hidden)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if impl.endswith(NO_FLIGHT):
        impl = impl.removesuffix(NO_FLIGHT)
        env["RINGPLUG_FLIGHT_RECORD"] = "0"
    command = [sys.executable, JOB, impl, str(steps), str(hidden), str(out)]
    if impl.startswith(("ring", "fabric")):
        command = [sys.executable, "-m", "ringplug.run.cli", "-np", str(ranks), *command]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if result.returncode != 0:
        raise SystemExit(
            f"ringplug-bench lightning: the {impl} job failed:\n{result.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def run(args: argparse.Namespace) -> int:
    if args.diagnose:
        return _run_diagnose(args)
    if args.flight_cost:
        return _run_flight_cost(args)
    if args.fabric_buffers:
        return _run_fabric_buffers(args)
    with tempfile.TemporaryDirectory(prefix="ringplug-bench-lightning-") as tmp:
        records, ratios = alternating_pairs(
            args.pairs,
            [
                ("ring/ddp", "ring", "ddp", 2),
                ("ring-1/none", "ring", "none", 1),
                ("ring/ddp tiny", "ring" + TINY, "ddp" + TINY, 2),
            ],
            lambda impl, ranks: _job(impl, ranks, args, Path(tmp)),
            lambda impl, ranks: f"{impl}-1" if ranks == 1 and impl == "ring" else impl,
        )
    ring_ddp = statistics.median(ratios["ring/ddp"])
    overhead = 1 - statistics.median(ratios["ring-1/none"])
    step_ms = {
        impl: statistics.median(
            1e3 * r.time_s / r.iterations for r in records if r.impl == impl + TINY
        )
        for impl in ("ring", "ddp")
    }
    print(f"# median RingStrategy / DDP throughput, 2 ranks: {ring_ddp:.3f}x (target >= 1.3)")
    print(f"# median RingStrategy overhead with 1 rank: {overhead * 100:.1f}% (target <= 5%)")
    print(
        f"# tiny MLP ({args.tiny_hidden} wide), 2 ranks, median time per step: RingStrategy "
        f"{step_ms['ring']:.2f} ms, DDP {step_ms['ddp']:.2f} ms "
        f"(DDP / RingStrategy {step_ms['ddp'] / step_ms['ring']:.2f}x)"
    )
    if args.json:
        write_job_json(
            args.json,
            "lightning",
            {
                "pairs": args.pairs,
                "steps": args.steps,
                "hidden": args.hidden,
                "median_ring_over_ddp": ring_ddp,
                "median_overhead_1_rank": overhead,
                "tiny_hidden": args.tiny_hidden,
                "tiny_steps": args.tiny_steps,
                "median_tiny_step_ms": step_ms,
            },
            records,
        )
    return 0


def _run_flight_cost(args: argparse.Namespace) -> int:
    """Throughput with the flight record over without it, alternating jobs, 2 ranks."""
    with tempfile.TemporaryDirectory(prefix="ringplug-bench-lightning-") as tmp:
        _, ratios = alternating_pairs(
            args.pairs,
            [
                ("flight/none", "ring", "ring" + NO_FLIGHT, 2),
                ("flight/none tiny", "ring" + TINY, "ring" + NO_FLIGHT + TINY, 2),
            ],
            lambda impl, ranks: _job(impl, ranks, args, Path(tmp)),
            lambda impl, ranks: impl,
        )
    for label, values in ratios.items():
        cost = 1 - statistics.median(values)
        print(f"# {label}: median throughput ratio {statistics.median(values):.3f} "
              f"(the flight record costs {cost * 100:.1f}%; target < 1%)")  # fmt: skip
    return 0


def _run_fabric_buffers(args: argparse.Namespace) -> int:
    """Throughput with rank 0's buffers kept over without, alternating jobs, 2 ranks."""
    with tempfile.TemporaryDirectory(prefix="ringplug-bench-lightning-") as tmp:
        _, ratios = alternating_pairs(
            args.pairs,
            [
                ("buffers/none", "fabric", "fabric-nobuffers", 2),
                ("buffers/none tiny", "fabric" + TINY, "fabric-nobuffers" + TINY, 2),
            ],
            lambda impl, ranks: _job(impl, ranks, args, Path(tmp)),
            lambda impl, ranks: impl,
        )
    for label, values in ratios.items():
        ratio = statistics.median(values)
        print(
            f"# Fabric, {label}: median throughput ratio {ratio:.3f} (keeping the buffers "
            f"costs {(1 - ratio) * 100:.1f}%; pairs: {', '.join(f'{v:.3f}' for v in values)})"
        )
    return 0


def _run_diagnose(args: argparse.Namespace) -> int:
    """The step-time breakdown's cost per step: each job (2 ranks) switches it on and off
    every few steps and compares the median step times of the two halves, so that the
    machine's drift between jobs does not enter the ratio."""
    costs: dict[str, list[float]] = {"MLP": [], "tiny MLP": []}
    records = []
    with tempfile.TemporaryDirectory(prefix="ringplug-bench-lightning-") as tmp:
        for job in range(args.pairs):
            for name, impl in (("MLP", "ring-toggle"), ("tiny MLP", "ring-toggle" + TINY)):
                result = _job(impl, 2, args, Path(tmp))
                on, off = result["step_ms_on"], result["step_ms_off"]
                costs[name].append(on / off - 1)
                records.append({"job": job, "model": name, **result})
                print(
                    f"job {job}: {name}: median step {on:.2f} ms with the breakdown, "
                    f"{off:.2f} ms without ({(on / off - 1) * 100:+.2f}%)",
                    flush=True,
                )
    medians = {name: statistics.median(values) for name, values in costs.items()}
    print(
        f"# median cost of the step-time breakdown per step, 2 ranks: MLP ({args.hidden} "
        f"wide) {medians['MLP'] * 100:+.2f}%, tiny MLP ({args.tiny_hidden} wide) "
        f"{medians['tiny MLP'] * 100:+.2f}% (target < 1%)"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {
                    "bench": "lightning-diagnose",
                    "pairs": args.pairs,
                    "steps": args.steps,
                    "tiny_steps": args.tiny_steps,
                    "median_cost": medians,
                    "jobs": records,
                },
                handle,
                indent=1,
            )
    return 0
