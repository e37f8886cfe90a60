"""`ringplug-bench fusion`: the engine on a real model's gradients, against its floors.

The gradients of ResNet-50 (161 tensors, 25.6 M parameters, shapes generated from the
architecture, nothing downloaded) are submitted asynchronously in backward order, as
autograd hooks would. Implementations, all in one run:

- ringplug: the engine, every gradient in its own array (copied into the fusion buffer
  and back out);
- ringplug-views: the engine, every gradient a view of one buffer (how a framework
  adapter that keeps gradients inside the fusion buffer hands them over: no copies);
- single: one allreduce of one preallocated buffer of the same bytes (the floor);
- copy: copying every gradient into one buffer and back out (memory work only, no
  communication): the extra floor for separate arrays;
- gloo: one torch.distributed gloo allreduce per gradient.

Small-message rows: one 4 KiB tensor submitted and waited for (small-1); 1,000 tensors of
4 KiB submitted together, one `allreduce_async` each (small-1000), as one
`grouped_allreduce` into new arrays (small-1000-grouped) and as one in place
(small-1000-grouped-in-place, the form of `ringplug.torch.grouped_allreduce_`), against one
4 MiB allreduce (single-4M).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

import ringplug
from ringplug.core import runtime
from ringplug.forensics.flight import FlightRecorder

from .allreduce import _gloo_group
from .common import ROUNDS, Record, environment, measure_side_by_side, median, write_json


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of torchvision's ResNet-50, in forward order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7))]
    shapes += [("bn1.weight", (64,)), ("bn1.bias", (64,))]
    in_channels = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
        for block in range(blocks):
            prefix = f"layer{stage + 1}.{block}"
            out_channels = width * 4
            for index, (cout, cin, k) in enumerate(
                ((width, in_channels, 1), (width, width, 3), (out_channels, width, 1)), start=1
            ):
                shapes.append((f"{prefix}.conv{index}.weight", (cout, cin, k, k)))
                shapes += [
                    (f"{prefix}.bn{index}.weight", (cout,)),
                    (f"{prefix}.bn{index}.bias", (cout,)),
                ]
            if block == 0:
                shapes.append((f"{prefix}.downsample.0.weight", (out_channels, in_channels, 1, 1)))
                shapes += [
                    (f"{prefix}.downsample.1.weight", (out_channels,)),
                    (f"{prefix}.downsample.1.bias", (out_channels,)),
                ]
            in_channels = out_channels
    shapes += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return shapes


def _without_flight(step: Callable[[], object]) -> Callable[[], None]:
    """`step` with the engine's flight record off (as with RINGPLUG_FLIGHT_RECORD=0)."""

    def run_it() -> None:
        engine = runtime.engine()
        kept, engine.flight = engine.flight, FlightRecorder(0)
        try:
            step()
        finally:
            engine.flight = kept

    return run_it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, default=15, help="timed iterations per impl")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--impls",
        default="ringplug,ringplug-views,single,copy,gloo,small",
        help="comma-separated subset (small = the small-message rows; no-flight = the "
        "ringplug and small-1000 rows again with the flight record off, for its cost)",
    )
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")


def run(args: argparse.Namespace) -> int:
    ringplug.init()
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    rank, ranks = ringplug.rank(), ringplug.size()
    shapes = resnet50_shapes()
    backward = list(reversed(shapes))
    counts = [int(np.prod(shape)) for _, shape in backward]
    total = sum(counts)
    arrays = [np.full(shape, rank + 1.0, np.float32) for _, shape in backward]
    registered = np.zeros(total, np.float32)
    views, offset = [], 0
    for (_, shape), count in zip(backward, counts, strict=True):
        views.append(registered[offset : offset + count].reshape(shape))
        offset += count
    single = np.zeros(total, np.float32)
    gather = np.empty(total, np.float32)

    def engine_step(tensors: list[np.ndarray]) -> None:
        handles = [
            ringplug.allreduce_async(t, op=ringplug.Sum, out=t, name=name)
            for (name, _), t in zip(backward, tensors, strict=True)
        ]
        for handle in handles:
            handle.wait()

    def copy_step() -> None:
        offset = 0
        for array, count in zip(arrays, counts, strict=True):
            gather[offset : offset + count] = array.reshape(-1)
            offset += count
        offset = 0
        for array, count in zip(arrays, counts, strict=True):
            array.reshape(-1)[...] = gather[offset : offset + count]
            offset += count

    runners = {
        "ringplug": lambda: engine_step(arrays),
        "ringplug-views": lambda: engine_step(views),
        "single": lambda: ringplug.allreduce(single, op=ringplug.Sum, out=single, name="single"),
        "copy": copy_step,
    }
    if "gloo" in impls:
        try:
            dist = _gloo_group()
            import torch

            torch_grads = [torch.from_numpy(a) for a in arrays]
            runners["gloo"] = lambda: [dist.all_reduce(t) for t in torch_grads]
        except ImportError:
            impls.remove("gloo")
    small = np.zeros(1024, np.float32)
    many = [np.zeros(1024, np.float32) for _ in range(1000)]
    four_mib = np.zeros(1 << 20, np.float32)

    def small_many() -> None:
        handles = [
            ringplug.allreduce_async(m, op=ringplug.Sum, out=m, name=f"small{i}")
            for i, m in enumerate(many)
        ]
        for handle in handles:
            handle.wait()

    def small_grouped() -> None:
        ringplug.grouped_allreduce(many, op=ringplug.Sum, name="small-group")

    def small_grouped_in_place() -> None:  # as ringplug.torch's grouped_allreduce_
        ringplug.grouped_allreduce(many, op=ringplug.Sum, out=many, name="small-group-in-place")

    if "small" in impls:
        runners["small-1"] = lambda: ringplug.allreduce(
            small, op=ringplug.Sum, out=small, name="small"
        )
        runners["small-1000"] = small_many
        runners["small-1000-grouped"] = small_grouped
        runners["small-1000-grouped-in-place"] = small_grouped_in_place
        runners["single-4M"] = lambda: ringplug.allreduce(
            four_mib, op=ringplug.Sum, out=four_mib, name="four"
        )
    small_rows = (
        "small-1",
        "small-1000",
        "small-1000-grouped",
        "small-1000-grouped-in-place",
        "single-4M",
    )
    if "no-flight" in impls:  # the same steps with RINGPLUG_FLIGHT_RECORD=0, interleaved
        runners["ringplug-no-flight"] = _without_flight(runners["ringplug"])
        runners["small-1000-no-flight"] = _without_flight(small_many)
    flightless = ("ringplug-no-flight", "small-1000-no-flight")
    chosen = [
        name
        for name in runners
        if name in impls
        or ("small" in impls and name in small_rows)
        or ("no-flight" in impls and name in flightless)
    ]
    timed = measure_side_by_side(
        {impl: runners[impl] for impl in chosen},
        budget_s=0.0,
        min_iters=args.iters,
        max_iters=args.iters,
        warmup=args.warmup,
    )
    records: list[Record] = []
    for impl, times in timed.items():
        nbytes = {
            "small-1": 4096,
            "small-1000": 4096 * 1000,
            "small-1000-grouped": 4096 * 1000,
            "small-1000-grouped-in-place": 4096 * 1000,
            "small-1000-no-flight": 4096 * 1000,
            "single-4M": 4 << 20,
        }.get(impl, total * 4)
        count = {
            "small-1": 1,
            "small-1000": 1000,
            "small-1000-grouped": 1000,
            "small-1000-grouped-in-place": 1000,
            "small-1000-no-flight": 1000,
            "single-4M": 1,
            "single": 1,
        }.get(impl, len(arrays))
        seconds = median(times)
        records.append(
            Record(
                impl,
                "sum",
                "float32",
                nbytes,
                ranks,
                seconds,
                nbytes / seconds / 1e9,
                nbytes / seconds / 1e9 * (2 * (ranks - 1) / ranks if ranks > 1 else 1.0),
                len(times),
                {"tensors": count},
            )
        )
    if "gloo" in impls:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        _print(records, ranks, total, len(arrays))
        if args.json:
            env = environment({"tensors": len(arrays), "parameters": total})
            write_json(args.json, "fusion", env, records)
            print(f"# wrote {args.json}")
    return 0


def _print(records: list[Record], ranks: int, parameters: int, tensors: int) -> None:
    by = {r.impl: r for r in records}
    print(
        f"# ringplug-bench fusion: ResNet-50 gradients ({tensors} tensors, {parameters:,} "
        f"float32 parameters), {ranks} ranks; time = median of the slowest rank; "
        f"implementations interleaved in {ROUNDS} rounds"
    )
    width = max([16, *(len(record.impl) for record in records)])
    print(f"# {'impl':<{width}} {'tensors':>7} {'MiB':>8} {'time ms':>10}")
    for record in records:
        print(
            f"  {record.impl:<{width}} {record.extra['tensors']:>7} "
            f"{record.bytes / 2**20:8.2f} {record.time_s * 1e3:10.3f}"
        )
    if {"ringplug", "single", "copy"} <= by.keys():
        floor = by["single"].time_s + by["copy"].time_s
        print(f"# ringplug / (single + copy) = {by['ringplug'].time_s / floor:.2f} (target <= 1.2)")
    if {"ringplug-views", "single"} <= by.keys():
        print(
            f"# ringplug-views / single = {by['ringplug-views'].time_s / by['single'].time_s:.2f}"
        )
    if {"ringplug", "gloo"} <= by.keys():
        print(f"# gloo / ringplug = {by['gloo'].time_s / by['ringplug'].time_s:.2f} (target >= 4)")
    if "small-1" in by:
        print(
            f"# one 4 KiB tensor, submit to result: {by['small-1'].time_s * 1e3:.3f} ms "
            "(target <= 0.3)"
        )
    for impl in ("small-1000", "small-1000-grouped", "small-1000-grouped-in-place"):
        if {impl, "single-4M"} <= by.keys():
            ratio = by[impl].time_s / by["single-4M"].time_s
            print(f"# {impl} (1000 x 4 KiB) / one 4 MiB = {ratio:.2f} (target <= 3)")
