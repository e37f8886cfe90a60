"""`ringplug-bench allreduce`: ringplug against MPI's own Allreduce and torch gloo, or on
GPUs (``--device cuda``) against torch.distributed's NCCL.

Every implementation reduces the same preallocated buffer in place, at every size, in
the same run; rows print like nccl-tests (time, algbw, busbw) with ratios at the end.
The "memory" row is the roofline of this machine: on CPUs the local work one rank of a
2-rank ring cannot avoid (copy S/2 in, add S/2, copy S/2 out), timed with numpy; on GPUs
a device-to-device copy of the buffer. The "python" row is the floor of an allreduce written
in Python: every rank sends its buffer to every other with mpi4py and adds the copies it
receives with numpy, with no negotiation, no checks and no deadline. On GPUs every timed
call includes waiting for the GPU (ringplug's `wait()` returns with the result complete;
torch's call is followed by a synchronize), so the times compare like for like.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable

import numpy as np

import ringplug
from ringplug.core.algorithms import ALLREDUCE, RING, AlgorithmTable

from .common import (
    ROUNDS,
    Record,
    environment,
    human_bytes,
    measure_side_by_side,
    median,
    plot_busbw,
    size_range,
    write_json,
)

IMPLS = ("ringplug", "ringplug-norecord", "ringplug-torch", "mpi", "gloo", "python", "memory")
DEFAULT_IMPLS = ("ringplug", "mpi", "gloo", "python", "memory")
# Sizes up to this get the "ringplug-norecord" row (the flight record's cost is a cost
# per call, which shows on small calls and hides on large ones).
NORECORD_UP_TO = 64 << 10
FLOOR_TAG = 7300
CUDA_IMPLS = ("ringplug", "nccl", "memory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-size", default="4K", help="smallest message (default 4K)")
    parser.add_argument("--max-size", default="256M", help="largest message (default 256M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16"])
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu: numpy buffers; cuda: torch CUDA tensors through NCCL (one GPU per rank)",
    )
    parser.add_argument(
        "--impls",
        default=None,
        help=f"comma-separated subset of {','.join(IMPLS)} (gloo needs torch; default "
        f"{','.join(DEFAULT_IMPLS)}; ringplug-norecord: ringplug with its flight record off, "
        f"in the same engine, up to {NORECORD_UP_TO >> 10}K; ringplug-torch: "
        "ringplug.torch.allreduce_ on a CPU tensor over the same memory, needs torch), "
        f"or with --device cuda of {','.join(CUDA_IMPLS)}",
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
    if "ringplug-norecord" in impls and buf.nbytes <= NORECORD_UP_TO:
        runners.update(_with_and_without_record(buf, "ringplug" in impls))
    elif "ringplug" in impls:
        runners["ringplug"] = lambda: ringplug.allreduce(buf, op=ringplug.Sum, out=buf)
    if "ringplug-torch" in impls:
        runners["ringplug-torch"] = _torch_in_place(buf)
    if "mpi" in impls:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        runners["mpi"] = lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
    if "gloo" in impls:
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(buf)
        runners["gloo"] = lambda: dist.all_reduce(tensor)
    if "python" in impls:
        runners["python"] = python_floor(buf)
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


def _with_and_without_record(buf: np.ndarray, with_record: bool) -> dict[str, Callable[[], object]]:
    """The "ringplug" row and the "ringplug-norecord" row: the same call in the same engine,
    with its flight record (as RINGPLUG_FLIGHT_RECORD says) and with none (as
    RINGPLUG_FLIGHT_RECORD=0), interleaved like any two rows. The record is the engine's
    `flight`, read on every call: each row puts its own there when the other's is, a
    comparison and a store that both rows pay alike."""
    from ..core import runtime
    from ..forensics.flight import FlightRecorder

    engine = runtime.engine()
    recorded, unrecorded = engine.flight, FlightRecorder(0)

    def recording() -> object:
        if engine.flight is not recorded:
            engine.flight = recorded
        return ringplug.allreduce(buf, op=ringplug.Sum, out=buf)

    def not_recording() -> object:
        if engine.flight is not unrecorded:
            engine.flight = unrecorded
        return ringplug.allreduce(buf, op=ringplug.Sum, out=buf)

    runners: dict[str, Callable[[], object]] = {}
    if with_record:
        runners["ringplug"] = recording
    runners["ringplug-norecord"] = not_recording
    return runners


def _torch_in_place(buf: np.ndarray) -> Callable[[], object]:
    """The "ringplug-torch" row: `buf` reduced in place through `ringplug.torch.allreduce_`,
    as a torch script (Horovod's, Lightning's metrics) calls it: on a tensor over `buf`."""
    import torch

    import ringplug.torch as rpt

    tensor = torch.from_numpy(buf)
    return lambda: rpt.allreduce_(tensor, "sum")


def python_floor(buf: np.ndarray) -> Callable[[], None]:
    """The "python" row: `buf` <- the sum of every rank's `buf`, each rank sending its whole
    buffer to every other (mpi4py) and adding what it receives (numpy), in place."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    peers = [peer for peer in range(comm.Get_size()) if peer != rank]
    copies = [np.empty_like(buf) for _ in peers]

    def exchange_and_add() -> None:
        requests = [
            comm.Irecv(copy, peer, FLOOR_TAG) for copy, peer in zip(copies, peers, strict=True)
        ]
        requests += [comm.Isend(buf, peer, FLOOR_TAG) for peer in peers]
        MPI.Request.Waitall(requests)
        for copy in copies:
            np.add(buf, copy, out=buf)

    return exchange_and_add


def _cuda_runners(impls: list[str], tensor) -> dict[str, Callable[[], object]]:
    import torch

    runners: dict[str, Callable[[], object]] = {}
    if "ringplug" in impls:
        import ringplug.torch as rpt

        runners["ringplug"] = lambda: rpt.allreduce_(tensor, "sum", name="bench.allreduce")
    if "nccl" in impls:
        import torch.distributed as dist

        def torch_nccl() -> None:
            dist.all_reduce(tensor)
            torch.cuda.synchronize()

        runners["nccl"] = torch_nccl
    if "memory" in impls:
        copy = torch.empty_like(tensor)

        def device_copy() -> None:
            copy.copy_(tensor)
            torch.cuda.synchronize()

        runners["memory"] = device_copy
    return runners


def _verify_cuda(dtype: np.dtype, count: int) -> None:
    import torch

    import ringplug.torch as rpt

    probe = torch.full(
        (count,), ringplug.rank() + 1, dtype=getattr(torch, dtype.name), device="cuda"
    )
    rpt.allreduce_(probe, "sum", name="bench.verify")
    size = ringplug.size()
    if not bool((probe == size * (size + 1) // 2).all()):
        raise SystemExit(f"ringplug-bench: wrong GPU allreduce result at {count} elements")


def _verify(dtype: np.dtype, count: int, impls: list[str]) -> None:
    """Check ringplug's answer (and the python floor's) before timing it: the sum of
    (rank + 1) over all ranks."""
    size = ringplug.size()
    expected = size * (size + 1) // 2
    checks = {"ringplug": lambda probe: ringplug.allreduce(probe, op=ringplug.Sum, out=probe)}
    if "python" in impls:
        checks["python"] = lambda probe: python_floor(probe)()
    if "ringplug-torch" in impls:
        checks["ringplug-torch"] = lambda probe: _torch_in_place(probe)()
    for impl, reduce_probe in checks.items():
        probe = np.full(count, ringplug.rank() + 1, dtype)
        reduce_probe(probe)
        if not np.all(probe == expected):
            raise SystemExit(f"ringplug-bench: wrong {impl} allreduce result at {count} elements")


def run(args: argparse.Namespace) -> int:
    ringplug.init()
    known = CUDA_IMPLS if args.device == "cuda" else IMPLS
    chosen = args.impls or ",".join(CUDA_IMPLS if args.device == "cuda" else DEFAULT_IMPLS)
    impls = [name.strip() for name in chosen.split(",") if name.strip()]
    unknown = sorted(set(impls) - set(known))
    if unknown:
        raise SystemExit(f"ringplug-bench: unknown impls {unknown}; choose from {known}")
    if args.device == "cuda":
        _start_cuda(impls)
    if "gloo" in impls:
        try:
            _gloo_group()
        except ImportError:
            if ringplug.rank() == 0:
                print("# torch is not installed: skipping gloo")
            impls.remove("gloo")
    if "ringplug-torch" in impls and importlib.util.find_spec("torch") is None:
        if ringplug.rank() == 0:
            print("# torch is not installed: skipping ringplug-torch")
        impls.remove("ringplug-torch")
    dtype = np.dtype(args.dtype)
    sizes = size_range(args.min_size, args.max_size)
    ranks = ringplug.size()
    bus_factor = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    leader = ringplug.rank() == 0
    if leader:
        print(
            f"# ringplug-bench allreduce: {ranks} ranks, {dtype.name}, op=sum, in place, on "
            f"{args.device}; time = median over iterations of the slowest rank; "
            f"implementations interleaved in {ROUNDS} rounds"
        )
        print(
            "# memory = a device-to-device copy of the buffer"
            if args.device == "cuda"
            else "# memory = one rank's unavoidable local work in a 2-rank ring "
            "(copy S/2 in, add S/2, copy S/2 out)"
        )
        if "ringplug-norecord" in impls:
            print(
                "# ringplug-norecord = ringplug with its flight record off (as with "
                "RINGPLUG_FLIGHT_RECORD=0), in the same engine, interleaved with the ringplug "
                f"row; up to {human_bytes(NORECORD_UP_TO)}; record = the record's cost"
            )
        if "python" in impls:
            print(
                "# python = the floor of an allreduce in Python: each rank sends its buffer to "
                "every other (mpi4py) and adds the copies (numpy); no negotiation, no checks"
            )
        header = f"#{'size':>7} " + "".join(
            f"| {name + ' us':>{_width(name)}} {'busbw':>6} " for name in impls
        )
        header += "| busbw ratios (ringplug / other)"
        print(header)
    records = _measure_sizes(args, impls, dtype, sizes, bus_factor, leader)
    if "gloo" in impls or "nccl" in impls:
        # gloo's threads must stop before the interpreter exits, or the C++ runtime aborts.
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    # Every rank asks (making the table, if no collective did, is collective).
    table = ringplug.core.runtime.engine().transport.algorithms
    if leader:
        _report(args, records, ranks, dtype, table)
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
        if args.device == "cuda":
            import torch

            _verify_cuda(dtype, count)
            buffer = torch.zeros(count, dtype=getattr(torch, dtype.name), device="cuda")
            runners = _cuda_runners(impls, buffer)
        else:
            _verify(dtype, count, impls)
            runners = _runners(impls, np.zeros(count, dtype))
        timed = measure_side_by_side(
            runners,
            budget_s=args.budget,
            min_iters=args.min_iters,
            max_iters=args.max_iters,
            warmup=args.warmup,
        )
        row: dict[str, Record] = {}
        for impl, times in timed.items():
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
            print(_table_row(nbytes, impls, row), flush=True)
    return records


def _width(name: str) -> int:
    """The width of `name`'s time column (its heading, at least 13)."""
    return max(13, len(name) + 3)


def _table_row(nbytes: int, impls: list[str], row: dict[str, Record]) -> str:
    """One size's line of the table: time and busbw of each implementation ("-" where one
    was not run at this size), then ringplug's busbw ratios, and the flight record's cost
    when the ringplug-norecord row ran beside it."""
    line = f"{human_bytes(nbytes):>8} "
    for name in impls:
        width = _width(name)
        if name in row:
            line += f"| {row[name].time_s * 1e6:{width}.1f} {row[name].busbw_gbs:6.2f} "
        else:
            line += f"| {'-':>{width}} {'-':>6} "
    if "ringplug" in row:
        ratios = [
            f"{name} {row['ringplug'].busbw_gbs / row[name].busbw_gbs:.2f}x"
            for name in impls
            if name != "ringplug" and name in row
        ]
        if "ringplug-norecord" in row:
            cost = row["ringplug"].time_s / row["ringplug-norecord"].time_s - 1
            ratios.append(f"record {cost * 100:+.1f}%")
        line += "| " + "  ".join(ratios)
    return line


def _start_cuda(impls: list[str]) -> None:
    """Put this rank on the GPU of its local rank, and start torch's NCCL group if asked."""
    import torch

    from ..core.gpu.plane import device_for_local_rank

    try:
        device = device_for_local_rank(ringplug.local_rank(), torch.cuda.device_count())
    except ringplug.RingplugError as error:
        raise SystemExit(f"ringplug-bench: --device cuda: {error}") from None
    torch.cuda.set_device(device)
    if "nccl" in impls:
        from ..torch.process_group import init_gloo_group

        init_gloo_group(backend="nccl")


def _report(
    args: argparse.Namespace,
    records: list[Record],
    ranks: int,
    dtype: np.dtype,
    table: AlgorithmTable,
) -> None:
    """Write the JSON and the plot (rank 0)."""
    from ringplug.core.transport.calibration import describe

    settings = ringplug.core.runtime.settings()
    ring_from = [start for start, name in table.bands[(ALLREDUCE, True)] if name == RING]
    env = environment(
        {
            "fusion_threshold": settings.fusion_threshold,
            # where the algorithm table (measured or fixed) puts allreduce on the ring
            "ring_threshold": ring_from[0] if ring_from else None,
            "algorithm_table": describe(table),
            "ring_segment": settings.ring_segment,
        }
    )
    if args.json:
        write_json(args.json, "allreduce", env, records)
        print(f"# wrote {args.json}")
    if args.plot:
        plot_busbw(args.plot, f"allreduce, {ranks} ranks, {dtype.name}", records)
        print(f"# wrote {args.plot}")
