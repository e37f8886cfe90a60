"""Multi-rank worker: every collective x dtype x size against the numpy reference.

Run as ``ringrun -np N python tests/workers/collectives.py OUTDIR``; each rank writes
OUTDIR/report-<rank>.json with one entry per case. The test reads the reports.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import numpy as np
from reference import (
    COUNTS,
    DTYPES,
    OPS,
    close,
    decode,
    encode,
    is_float,
    op_applies,
    reduce_reference,
    storage,
    values_for,
)

import ringplug


def allreduce_cases():
    case = 0
    for dtype in DTYPES:
        for op in OPS:
            if not op_applies(op, dtype):
                continue
            for count in COUNTS:
                case += 1
                yield f"allreduce/{op}/{dtype}/{count}", case, op, dtype, count


def expected_case_names(size: int) -> list[str]:
    """The names every rank must report, so a test notices cases that silently vanished."""
    names = [name for name, *_ in allreduce_cases()]
    names += [f"allreduce-scaled/{d}" for d in DTYPES if is_float(d)]
    names += ["allreduce-inplace", "allreduce-noncontiguous", "allreduce-multidim"]
    names += ["grouped-inplace-average", "fused-different-scales"]
    names += [f"allgather/{d}/{c}" for d in DTYPES for c in (0, 3, 100_001)]
    names += [
        f"broadcast/{root}/{d}/{c}"
        for root in range(size)
        for d in DTYPES
        for c in (1, 1001, 1_000_003)
    ]
    names += [f"reducescatter/{op}/{rows}" for op in OPS for rows in (1, 5, 1001, 250_001)]
    names += [f"alltoall/{d}" for d in DTYPES] + ["alltoall-even"]
    names += ["barrier", "broadcast_object/small", "broadcast_object/large", "allgather_object"]
    return names


def main(outdir: Path) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    report: dict[str, dict] = {}

    def record(name: str, ok: bool, worst: float = 0.0, detail: str = "") -> None:
        report[name] = {"ok": bool(ok), "worst": worst, "detail": detail}

    def check(name, fn):
        try:
            fn(name)
        except Exception:  # noqa: BLE001 - the test reports whatever went wrong
            record(name, False, detail=traceback.format_exc())

    def run_allreduce(name, case, op, dtype, count):
        inputs = [values_for(op, dtype, count, r, case) for r in range(size)]
        mine = encode(inputs[rank], dtype)
        result = ringplug.allreduce(mine, op=op, dtype="bfloat16" if dtype == "bfloat16" else None)
        ok, worst = close(decode(result, dtype), reduce_reference(op, dtype, inputs), op, dtype)
        unchanged = np.array_equal(mine, encode(inputs[rank], dtype))  # out-of-place
        record(name, ok and unchanged and result.dtype == storage(dtype), worst)

    for name, case, op, dtype, count in allreduce_cases():
        check(name, lambda n, a=(case, op, dtype, count): run_allreduce(n, *a))

    def scaled(name, dtype=None):
        dtype = name.split("/")[1]
        inputs = [values_for("sum", dtype, 513, r, 7) for r in range(size)]
        result = ringplug.allreduce(
            encode(inputs[rank], dtype),
            op=ringplug.Sum,
            prescale_factor=0.5,
            postscale_factor=4.0,
            dtype="bfloat16" if dtype == "bfloat16" else None,
        )
        expected = reduce_reference("sum", dtype, inputs, pre=0.5, post=4.0)
        record(name, *close(decode(result, dtype), expected, "sum", dtype))

    for dtype in DTYPES:
        if is_float(dtype):
            check(f"allreduce-scaled/{dtype}", scaled)

    def inplace(name):
        inputs = [values_for("sum", "float32", 300_000, r, 8) for r in range(size)]
        buf = encode(inputs[rank], "float32")
        out = ringplug.allreduce(buf, op="sum", out=buf)
        ok, worst = close(
            decode(buf, "float32"), reduce_reference("sum", "float32", inputs), "sum", "float32"
        )
        record(name, ok and out is buf, worst)

    def noncontiguous(name):
        inputs = [values_for("max", "float64", 2002, r, 9) for r in range(size)]
        base = encode(inputs[rank], "float64").reshape(1001, 2)
        view = base[:, 1]  # strided
        target = np.zeros((2, 1001))[0]
        result = ringplug.allreduce(view, op=ringplug.Max, out=target)
        expected = reduce_reference("max", "float64", [x.reshape(1001, 2)[:, 1] for x in inputs])
        ok, worst = close(result, expected, "max", "float64")
        record(name, ok and result is target, worst)

    def multidim(name):
        inputs = [values_for("min", "int32", 3 * 5 * 7, r, 10) for r in range(size)]
        result = ringplug.allreduce(encode(inputs[rank], "int32").reshape(3, 5, 7), op="min")
        expected = reduce_reference("min", "int32", inputs).reshape(3, 5, 7)
        record(name, result.shape == (3, 5, 7) and np.array_equal(result, expected))

    def grouped_inplace_average(name):
        # Separate arrays reduced where they lie (the ring's Pieces), averaged as one.
        counts = (5, 70_001, 1)
        inputs = [
            [values_for("sum", "float64", c, r, 11 + i) for i, c in enumerate(counts)]
            for r in range(size)
        ]
        mine = [encode(x, "float64") for x in inputs[rank]]
        results = ringplug.grouped_allreduce(mine, op="average", out=mine, name=name)
        ok = all(result is array for result, array in zip(results, mine, strict=True))
        worst = 0.0
        for i, result in enumerate(results):
            expected = reduce_reference("average", "float64", [x[i] for x in inputs])
            good, err = close(result, expected, "average", "float64")
            ok, worst = ok and good, max(worst, err)
        record(name, ok, worst)

    def fused_different_scales(name):
        # Submitted together, so likely fused in one batch, each with its own postscale.
        inputs = [values_for("sum", "float64", 4099, r, 14) for r in range(size)]
        handles = [
            ringplug.allreduce_async(
                encode(inputs[rank], "float64"),
                op="average",
                postscale_factor=f,
                name=f"{name}/{f}",
            )
            for f in (1.0, 3.0)
        ]
        ok, worst = True, 0.0
        for factor, handle in zip((1.0, 3.0), handles, strict=True):
            expected = reduce_reference("average", "float64", inputs, post=factor)
            good, err = close(handle.wait(), expected, "average", "float64")
            ok, worst = ok and good, max(worst, err)
        record(name, ok, worst)

    check("grouped-inplace-average", grouped_inplace_average)
    check("fused-different-scales", fused_different_scales)
    check("allreduce-inplace", inplace)
    check("allreduce-noncontiguous", noncontiguous)
    check("allreduce-multidim", multidim)

    def allgather(name):
        _, dtype, rows = name.split("/")
        rows = int(rows)
        parts = [
            encode(values_for("sum", dtype, (rows + r) * 3, r, 11), dtype).reshape(-1, 3)
            for r in range(size)
        ]
        if rows == 0:
            parts[0] = parts[0][:0]  # rank 0 contributes no rows at all
        result = ringplug.allgather(parts[rank], dtype="bfloat16" if dtype == "bfloat16" else None)
        record(name, np.array_equal(result, np.concatenate(parts)))

    for dtype in DTYPES:
        for rows in (0, 3, 100_001):
            check(f"allgather/{dtype}/{rows}", allgather)

    def broadcast(name):
        _, root, dtype, count = name.split("/")
        root, count = int(root), int(count)
        data = [encode(values_for("sum", dtype, count, r, 12), dtype) for r in range(size)]
        raw = "bfloat16" if dtype == "bfloat16" else None
        mine = data[rank].copy()
        result = ringplug.broadcast(mine, root_rank=root, dtype=raw)
        in_place = data[rank].copy()
        ringplug.broadcast(in_place, root_rank=root, out=in_place, dtype=raw)
        record(
            name,
            np.array_equal(result, data[root])
            and np.array_equal(in_place, data[root])
            and np.array_equal(mine, data[rank]),
        )

    for root in range(size):
        for dtype in DTYPES:
            for count in (1, 1001, 1_000_003):
                check(f"broadcast/{root}/{dtype}/{count}", broadcast)

    def reducescatter(name):
        _, op, rows = name.split("/")
        rows = int(rows)
        inputs = [values_for(op, "float64", rows * 3, r, 13) for r in range(size)]
        block = ringplug.reducescatter(encode(inputs[rank], "float64").reshape(rows, 3), op=op)
        full = reduce_reference(op, "float64", inputs).reshape(rows, 3)
        base, extra = divmod(rows, size)
        start = rank * base + min(rank, extra)
        mine = full[start : start + base + (1 if rank < extra else 0)]
        record(name, *close(block, mine, op, "float64"))

    for op in OPS:
        for rows in (1, 5, 1001, 250_001):
            check(f"reducescatter/{op}/{rows}", reducescatter)

    def alltoall(name):
        dtype = name.split("/")[1]
        # splits[s][d]: rows rank s sends to rank d
        splits = [[(s + 2 * d) % 4 for d in range(size)] for s in range(size)]
        sent = [
            encode(values_for("sum", dtype, sum(splits[s]) * 2, s, 14), dtype).reshape(-1, 2)
            for s in range(size)
        ]
        received, counts = ringplug.alltoall(
            sent[rank], splits[rank], dtype="bfloat16" if dtype == "bfloat16" else None
        )
        expected = []
        for s in range(size):
            start = sum(splits[s][:rank])
            expected.append(sent[s][start : start + splits[s][rank]])
        record(
            name,
            np.array_equal(received, np.concatenate(expected))
            and list(counts) == [splits[s][rank] for s in range(size)],
        )

    for dtype in DTYPES:
        check(f"alltoall/{dtype}", alltoall)

    def alltoall_even(name):
        sent = np.arange(size * 4, dtype=np.int64) + 1000 * rank
        received, counts = ringplug.alltoall(sent)
        expected = np.concatenate(
            [np.arange(size * 4)[rank * 4 : rank * 4 + 4] + 1000 * s for s in range(size)]
        )
        record(name, np.array_equal(received, expected) and list(counts) == [4] * size)

    check("alltoall-even", alltoall_even)

    def barrier(name):
        ringplug.barrier()
        record(name, True)

    def broadcast_object_small(name):
        value = ringplug.broadcast_object({"rank": rank, "tag": "small"}, root_rank=size - 1)
        record(name, value == {"rank": size - 1, "tag": "small"})

    def broadcast_object_large(name):
        big = {"rank": rank, "blob": bytes([rank]) * 300_000}
        value = ringplug.broadcast_object(big, root_rank=1)
        record(name, value == {"rank": 1, "blob": bytes([1]) * 300_000})

    def allgather_object(name):
        values = ringplug.allgather_object({"rank": rank, "pad": "x" * (rank * 100_000)})
        record(name, values == [{"rank": r, "pad": "x" * (r * 100_000)} for r in range(size)])

    check("barrier", barrier)
    check("broadcast_object/small", broadcast_object_small)
    check("broadcast_object/large", broadcast_object_large)
    check("allgather_object", allgather_object)

    big = np.ones(3 << 20, np.float32)  # 12 MiB: above the default ring threshold
    ringplug.allreduce(big, op="sum", out=big)
    path = ringplug.core.runtime.engine().transport.last_path
    summary = {"rank": rank, "size": size, "path_12M": path, "cases": report}
    (outdir / f"report-{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
