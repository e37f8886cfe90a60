"""What every ringplug-bench subcommand shares: timing, sizes, tables, JSON and plots."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from importlib import metadata

import numpy as np

import ringplug
from ringplug.config import parse_bytes


@dataclass
class Record:
    """One measured implementation at one size (a row of the JSON `results`)."""

    impl: str
    op: str
    dtype: str
    bytes: int
    ranks: int
    time_s: float  # median over iterations of the slowest rank's time
    algbw_gbs: float
    busbw_gbs: float
    iterations: int
    extra: dict = field(default_factory=dict)


def size_range(low: str, high: str) -> list[int]:
    """Powers of two from `low` to `high` bytes, both given like "4K" or "256M"."""
    lo, hi = parse_bytes(low), parse_bytes(high)
    if lo <= 0 or hi < lo:
        raise SystemExit(f"ringplug-bench: need 0 < min-size <= max-size, got {low}..{high}")
    sizes, size = [], lo
    while size <= hi:
        sizes.append(size)
        size *= 2
    return sizes


def human_bytes(count: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if count >= scale and count % scale == 0:
            return f"{count // scale}{unit}"
    return f"{count}B"


# Rounds of `measure_side_by_side`: each implementation runs a tenth of its iterations per
# round, so that a change of the machine's load falls on every implementation alike.
ROUNDS = 10


def measure_side_by_side(
    runs: dict[str, Callable[[], object]],
    *,
    budget_s: float,
    min_iters: int,
    max_iters: int,
    warmup: int,
    rounds: int = ROUNDS,
) -> dict[str, list[float]]:
    """Time each of `runs` on every rank, interleaved; returns, for each, the per-iteration
    times of the slowest rank.

    Each gets `budget_s` seconds of iterations (as many as its last warm-up call says, within
    `min_iters`..`max_iters`, chosen by rank 0 so that all ranks run the same collectives).
    They run in `rounds` rounds, each taking its share of every one's iterations in turn,
    the order rotated each round: on a shared machine, whose load drifts over seconds, a
    block per implementation would compare one moment's load with another's. Each share
    starts with one untimed call, which pays for the switch.
    """
    counts: dict[str, int] = {}
    for name, run in runs.items():
        warm = 0.0
        for _ in range(warmup):
            start = time.perf_counter()
            run()
            warm = time.perf_counter() - start
        counts[name] = int(np.clip(budget_s / max(warm, 1e-7), min_iters, max_iters))
    counts = ringplug.broadcast_object(counts, 0)
    times = {name: np.empty(count) for name, count in counts.items()}
    names = list(runs)
    for turn in range(rounds):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            run, count = runs[name], counts[name]
            first, end = count * turn // rounds, count * (turn + 1) // rounds  # its share
            if first == end:
                continue
            ringplug.barrier()  # every rank starts its share together
            run()  # untimed: the switch (ranks leaving the barrier apart, caches) costs it
            for i in range(first, end):
                start = time.perf_counter()
                run()
                times[name][i] = time.perf_counter() - start
    return {name: list(ringplug.allreduce(t, op=ringplug.Max)) for name, t in times.items()}


def median(values: Iterable[float]) -> float:
    return float(statistics.median(values))


def environment(extra: dict | None = None) -> dict:
    """Facts that make two benchmark runs comparable."""
    from mpi4py import MPI

    versions = {}
    for package in ("numpy", "mpi4py", "mpich", "torch"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ringplug": ringplug.__version__,
        "versions": versions,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "ranks": ringplug.size(),
        "command": " ".join(sys.argv),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    }
    env.update(extra or {})
    return env


def write_json(path: str, bench: str, env: dict, records: list[Record]) -> None:
    document = {"bench": bench, "env": env, "results": []}
    for record in records:
        row = asdict(record)
        row.update(row.pop("extra"))
        document["results"].append(row)
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")


def write_job_json(path: str, bench: str, extra: dict, records: list[Record]) -> None:
    """`write_json` for the benches run as plain commands, which start their jobs
    themselves: this process reads the environment facts as a world of one."""
    import ringplug

    ringplug.init()
    write_json(path, bench, environment(extra), records)
    print(f"# wrote {path}")


def plot_busbw(path: str, title: str, records: list[Record]) -> None:
    """Bus bandwidth against message size, one line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "ringplug-bench: --plot needs matplotlib: pip install 'ringplug[bench]'"
        ) from None
    figure, axes = plt.subplots(figsize=(8, 5))
    for impl in dict.fromkeys(r.impl for r in records):
        rows = [r for r in records if r.impl == impl]
        axes.plot([r.bytes for r in rows], [r.busbw_gbs for r in rows], marker="o", label=impl)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def alternating_pairs(
    pairs: int,
    comparisons: list[tuple[str, str, str, int]],
    job: Callable[[str, int], dict],
    label: Callable[[str, int], str],
) -> tuple[list[Record], dict[str, list[float]]]:
    """Run training jobs in alternating pairs, so that drift on a shared machine hits both
    sides of a comparison alike.

    `comparisons` holds (name, first impl, second impl, ranks); `job(impl, ranks)` runs one
    job and returns its result (``samples_per_s``, ``seconds``, ``steps_timed``, ``ranks``,
    ``parameters``). Returns the records (labelled by `label(impl, ranks)`) and, per
    comparison, the first/second throughput ratio of each pair.
    """
    records: list[Record] = []
    ratios: dict[str, list[float]] = {name: [] for name, *_ in comparisons}
    for pair in range(pairs):
        for name, first, second, ranks in comparisons:
            order = (first, second) if pair % 2 == 0 else (second, first)
            results = {impl: job(impl, ranks) for impl in order}
            ratio = results[first]["samples_per_s"] / results[second]["samples_per_s"]
            ratios[name].append(ratio)
            for impl, result in results.items():
                records.append(
                    Record(
                        label(impl, ranks),
                        "train",
                        "float32",
                        0,
                        result["ranks"],
                        result["seconds"],
                        0.0,
                        0.0,
                        result["steps_timed"],
                        {
                            "samples_per_s": result["samples_per_s"],
                            "pair": pair,
                            "parameters": result["parameters"],
                        },
                    )
                )
            print(
                f"pair {pair}: {name} = {ratio:.3f} ("
                + ", ".join(f"{k} {v['samples_per_s']:.1f} samples/s" for k, v in results.items())
                + ")",
                flush=True,
            )
    return records, ratios
