"""`ringplug-bench allreduce`: ringplug against MPI's own Allreduce and torch gloo.

Every implementation reduces the same preallocated buffer in place, at every size, in
the same run; rows print like nccl-tests (time, algbw, busbw) with ratios at the end.
The "memory" row is the roofline of this machine: the local work one rank of a 2-rank
ring cannot avoid (copy S/2 in, add S/2, copy S/2 out), timed with numpy.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

import ringplug

from .common import (
    Record,
    environment,
    human_bytes,
    measure,
    median,
    plot_busbw,
    size_range,
    write_json,
)

IMPLS = ("ringplug", "mpi", "gloo", "memory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-size", default="4K", help="smallest message (default 4K)")
    parser.add_argument("--max-size", default="256M", help="largest message (default 256M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16"])
    parser.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help=f"comma-separated subset of {','.join(IMPLS)} (gloo needs torch)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=0.3,
        help="seconds of timed iterations per size and implementation",
    )
    parser.add_argument("--min-iters", type=int, default=5)
    parser.add_argument("--max-iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    parser.add_argument("--plot", metavar="PATH.png", help="draw busbw against size")


def _gloo_group():
    """A torch.distributed gloo group over the same ranks, bootstrapped through ringplug."""
    import torch.distributed as dist

    from ..torch.process_group import init_gloo_group

    init_gloo_group()
    return dist


def _runners(impls: list[str], buf: np.ndarray) -> dict[str, Callable[[], object]]:
    runners: dict[str, Callable[[], object]] = {}
    if "ringplug" in impls:
        runners["ringplug"] = lambda: ringplug.allreduce(buf, op=ringplug.Sum, out=buf)
    if "mpi" in impls:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        runners["mpi"] = lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
    if "gloo" in impls:
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(buf)
        runners["gloo"] = lambda: dist.all_reduce(tensor)
    if "memory" in impls:
        half = buf.size // 2
        peer = np.zeros_like(buf)  # stands for the neighbour's memory
        landing = np.zeros(half, buf.dtype)

        def local_work() -> None:
            np.copyto(landing, peer[:half])  # copy S/2 in
            np.add(buf[:half], landing, out=buf[:half])  # add S/2
            np.copyto(buf[half:], peer[half:])  # copy S/2 out

        runners["memory"] = local_work
    return runners


def _verify(dtype: np.dtype, count: int) -> None:
    """Check ringplug's answer before timing it: sum of (rank + 1) over all ranks."""
    probe = np.full(count, ringplug.rank() + 1, dtype)
    ringplug.allreduce(probe, op=ringplug.Sum, out=probe)
    size = ringplug.size()
    expected = size * (size + 1) // 2
    if not np.all(probe == expected):
        raise SystemExit(f"ringplug-bench: wrong allreduce result at {count} elements")


def run(args: argparse.Namespace) -> int:
    ringplug.init()
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        raise SystemExit(f"ringplug-bench: unknown impls {unknown}; choose from {IMPLS}")
    if "gloo" in impls:
        try:
            _gloo_group()
        except ImportError:
            if ringplug.rank() == 0:
                print("# torch is not installed: skipping gloo")
            impls.remove("gloo")
    dtype = np.dtype(args.dtype)
    sizes = size_range(args.min_size, args.max_size)
    ranks = ringplug.size()
    bus_factor = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    leader = ringplug.rank() == 0
    if leader:
        print(
            f"# ringplug-bench allreduce: {ranks} ranks, {dtype.name}, op=sum, in place; "
            "time = median over iterations of the slowest rank"
        )
        print(
            "# memory = one rank's unavoidable local work in a 2-rank ring "
            "(copy S/2 in, add S/2, copy S/2 out)"
        )
        header = f"#{'size':>7} " + "".join(f"| {name + ' us':>13} {'busbw':>6} " for name in impls)
        header += "| busbw ratios (ringplug / other)"
        print(header)
    records = _measure_sizes(args, impls, dtype, sizes, bus_factor, leader)
    if "gloo" in impls:
        # gloo's threads must stop before the interpreter exits, or the C++ runtime aborts.
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    if leader:
        _report(args, records, ranks, dtype)
    return 0


def _measure_sizes(
    args: argparse.Namespace,
    impls: list[str],
    dtype: np.dtype,
    sizes: list[int],
    bus_factor: float,
    leader: bool,
) -> list[Record]:
    """Verify, then time, every implementation at every size; rank 0 prints each row."""
    ranks = ringplug.size()
    records: list[Record] = []
    for nbytes in sizes:
        count = max(1, nbytes // dtype.itemsize)
        buf = np.zeros(count, dtype)
        _verify(dtype, count)
        row: dict[str, Record] = {}
        for impl, runner in _runners(impls, buf).items():
            times = measure(
                runner,
                budget_s=args.budget,
                min_iters=args.min_iters,
                max_iters=args.max_iters,
                warmup=args.warmup,
            )
            seconds = median(times)
            algbw = count * dtype.itemsize / seconds / 1e9
            busbw = algbw * (1.0 if impl == "memory" else bus_factor)
            row[impl] = Record(
                impl,
                "sum",
                dtype.name,
                count * dtype.itemsize,
                ranks,
                seconds,
                algbw,
                busbw,
                len(times),
            )
        records.extend(row.values())
        if leader:
            line = f"{human_bytes(nbytes):>8} "
            line += "".join(
                f"| {row[name].time_s * 1e6:13.1f} {row[name].busbw_gbs:6.2f} " for name in impls
            )
            if "ringplug" in row:
                ratios = [
                    f"{name} {row['ringplug'].busbw_gbs / row[name].busbw_gbs:.2f}x"
                    for name in impls
                    if name != "ringplug"
                ]
                line += "| " + "  ".join(ratios)
            print(line, flush=True)
    return records


def _report(args: argparse.Namespace, records: list[Record], ranks: int, dtype: np.dtype) -> None:
    """Write the JSON and the plot (rank 0)."""
    settings = ringplug.core.runtime.settings()
    env = environment(
        {
            "fusion_threshold": settings.fusion_threshold,
            "ring_threshold": settings.ring_threshold,
            "ring_segment": settings.ring_segment,
        }
    )
    if args.json:
        write_json(args.json, "allreduce", env, records)
        print(f"# wrote {args.json}")
    if args.plot:
        plot_busbw(args.plot, f"allreduce, {ranks} ranks, {dtype.name}", records)
        print(f"# wrote {args.plot}")
