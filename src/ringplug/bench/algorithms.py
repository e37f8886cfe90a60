"""`ringplug-bench algorithms`: the algorithm table's calibration, printed, and its choice
against MPI's own Allreduce.

Run under the launcher, e.g. ``ringrun -np 4 ringplug-bench algorithms``. It measures the
table afresh (what `RINGPLUG_CALIBRATION=fresh` does at a job's first collective, on its own
communicator, without touching the cache) and prints: every candidate's measured points
with the fitted alpha-beta model's prediction and error at each, the model, and the
crossovers. Then, side by side in one run at each ``--sizes``: MPI's own Allreduce (mpi4py,
blocking, in place), each allreduce algorithm alone (ringplug's transport, no engine; the
hierarchical one where the ranks span several hosts) and ``ringplug.allreduce`` with the
measured table, each as a ratio to MPI's time.

Example:
    ringrun -np 4 ringplug-bench algorithms --sizes 4K,64K,1M,16M --json algorithms.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

import ringplug
from ringplug.config import parse_bytes

from .common import environment, human_bytes, measure_side_by_side, median

if TYPE_CHECKING:
    from ringplug.core.algorithms import AlgorithmTable
    from ringplug.core.transport.host import Transport

ALGORITHMS = ("mpi", "doubling", "ring")
HIERARCHICAL = "hierarchical"  # a row only where the job's ranks span several hosts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", default="4K,64K,1M,16M", help="allreduce sizes compared (default 4K,64K,1M,16M)"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds the calibration may take (default RINGPLUG_CALIBRATION_SECONDS)",
    )
    parser.add_argument(
        "--budget", type=float, default=0.3, help="seconds of timed calls per size and row"
    )
    parser.add_argument("--json", metavar="PATH", help="write the table and the comparison")


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from ringplug.core import runtime
    from ringplug.core.transport import calibration
    from ringplug.core.transport.host import Transport

    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    settings = runtime.settings()
    transport = Transport(MPI.COMM_WORLD, settings)
    # Its waits spin and yield as the engine's do: with the waiter's defaults a rank with a
    # core of its own slept between tests, and MPI's Iallreduce of 1 MiB took 507 us
    # where the engine's took 170 (2 ranks), which moved the crossovers too.
    transport.waiter.spin_like(runtime.engine().waiter)
    deadline = settings.calibration_seconds if args.deadline is None else args.deadline
    began = time.perf_counter()
    table = calibration.measure(transport, deadline)
    took = time.perf_counter() - began
    # ringplug.allreduce below uses this very table (every rank has the same bytes).
    runtime.engine().transport.use_algorithms(table)
    if rank == 0:
        print(
            f"# ringplug-bench algorithms: {size} ranks; calibration {took:.2f} s "
            f"(deadline {deadline:g} s), {table.source}"
        )
        for line in table_lines(table):
            print(line)
    sizes = [parse_bytes(text) for text in args.sizes.split(",")]
    rows = compare(transport, sizes, args.budget)
    transport.free()
    if rank == 0:
        for line in comparison_lines(rows):
            print(line)
        if args.json:
            document = {
                "bench": "algorithms",
                "env": environment({"calibration_s": took, "deadline_s": deadline}),
                "table": json.loads(table.to_json()),
                "comparison": rows,
            }
            with open(args.json, "w") as stream:
                json.dump(document, stream, indent=1)
            print(f"# wrote {args.json}")
    ringplug.shutdown()
    return 0


def table_lines(table: AlgorithmTable) -> list[str]:
    """The measured points, the models with their errors, and the crossovers."""
    from ringplug.core.transport.calibration import model_text

    lines = []
    if not table.models:
        return [f"# no models: {table.note}"]
    sizes = [n for n, _ in next(iter(table.models.values())).points]
    head = " ".join(f"{human_bytes(n):>16}" for n in sizes)
    lines.append(f"# {'series':<20} {head} | model")
    lines.append(f"# {'':<20} {'us (model error)':>16}")
    for name, model in sorted(table.models.items()):
        cells = []
        for n, seconds in model.points:
            error = model.seconds(n) / seconds - 1
            cells.append(f"{seconds * 1e6:>9.1f} ({error:+4.0%})")
        lines.append(f"# {name:<20} {' '.join(f'{c:>16}' for c in cells)} | {model_text(model)}")
    lines.append("# crossovers (where the measured points cross; the bands every rank uses):")
    for (kind, reduces), bands in table.bands.items():
        label = (
            kind if reduces or kind in ("allgather", "broadcast") else f"{kind} (MPI cannot reduce)"
        )
        text = ", ".join(
            f"{name} from {human_bytes(start) if start else '0'}" for start, name in bands
        )
        lines.append(f"#   {label:<36} {text}")
    return lines


def compare(transport: Transport, sizes: list[int], budget: float) -> list[dict]:
    """Each size: MPI's Allreduce, each algorithm alone, and ringplug.allreduce, timed side
    by side (medians of the slowest rank)."""
    from mpi4py import MPI

    from ringplug.core import runtime
    from ringplug.core.dtypes import DType
    from ringplug.core.ops import ReduceOp

    engine = runtime.engine()
    rows = []
    chosen: list[str] = []
    algorithms = [*ALGORITHMS, HIERARCHICAL] if transport.spans_hosts() else list(ALGORITHMS)

    def algorithm(name: str, buffer: np.ndarray) -> Callable[[], None]:
        return lambda: transport.allreduce_by(name, buffer, ReduceOp.SUM, DType.FLOAT32)

    def mpi_own(buffer: np.ndarray) -> Callable[[], None]:
        return lambda: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buffer)

    def through_the_engine(buffer: np.ndarray) -> Callable[[], None]:
        def call() -> None:
            ringplug.allreduce(buffer, op=ringplug.Sum, out=buffer, name="bench")
            chosen.append(engine.transport.last_path)

        return call

    for nbytes in sizes:
        count = nbytes // 4
        runs: dict[str, Callable[[], object]] = {
            "MPI Allreduce": mpi_own(np.zeros(count, np.float32)),
            **{name: algorithm(name, np.zeros(count, np.float32)) for name in algorithms},
            "ringplug": through_the_engine(np.zeros(count, np.float32)),
        }
        times = measure_side_by_side(runs, budget_s=budget, min_iters=3, max_iters=2000, warmup=2)
        mpi_time = median(times["MPI Allreduce"])
        # "eager": the data travelled in the negotiation (RINGPLUG_EAGER_THRESHOLD)
        row: dict = {"bytes": nbytes, "chosen": chosen[-1]}
        for name, values in times.items():
            row[name] = {"time_s": median(values), "ratio_to_mpi": mpi_time / median(values)}
        rows.append(row)
    return rows


def comparison_lines(rows: list[dict]) -> list[str]:
    hierarchy = [HIERARCHICAL] if rows and HIERARCHICAL in rows[0] else []
    names = ["MPI Allreduce", *ALGORITHMS, *hierarchy, "ringplug"]
    lines = [
        "# allreduce, float32 sum; median of the slowest rank, us (speed against MPI's own "
        "Allreduce: its time / this time)",
        f"# {'size':>5} | " + " | ".join(f"{name:>18}" for name in names) + " | table chose",
    ]
    for row in rows:
        cells = [f"{row['MPI Allreduce']['time_s'] * 1e6:>18.1f}"]
        for name in names[1:]:
            cell = row[name]
            cells.append(f"{cell['time_s'] * 1e6:>9.1f} ({cell['ratio_to_mpi']:5.2f}x)")
        lines.append(
            f"# {human_bytes(row['bytes']):>5} | "
            + " | ".join(f"{c:>18}" for c in cells)
            + f" | {row['chosen']}"
        )
    return lines
