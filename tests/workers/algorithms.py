"""Multi-rank worker: every algorithm of the table against numpy, and the calibration, in one
job per world size.

Run as ``ringrun -np N python tests/workers/algorithms.py OUTDIR`` with
``RINGPLUG_CALIBRATION=fresh`` and ``XDG_CACHE_HOME`` set; each rank writes
OUTDIR/algorithms-<rank>.json:

- "cases": {case: {"ok": bool, "path": the algorithm that ran, "detail": str}}: each kind
  with each of its algorithms forced (the same table on every rank), on dtypes, ops and
  sizes where every rank can compute the expected result from every rank's inputs;
- "table": the job's calibrated table (JSON), made at the first collective;
- "cached": the table a second communicator got (rank 0 loads it from the cache);
- "deadline": the table of a measurement given no time at all;
- "refused": on one host, the error of a communicator that forces the hierarchical
  allreduce (it needs several hosts);
- "set_table": on 3 ranks or more, the table of the process set of ranks 0..p-2 (measured
  at the set's first collective; None on the rank outside it).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

import ringplug
from ringplug.core import runtime
from ringplug.core.algorithms import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    CANDIDATES,
    HIERARCHICAL,
    REDUCESCATTER,
    fixed_table,
)
from ringplug.core.transport import calibration
from ringplug.core.transport.host import Transport

SIZES = (1, 7, 1000, 40_003)  # elements; 40,003 x 4 bytes spans several ring segments


def inputs(rank: int, count: int, dtype: str, case: str) -> np.ndarray:
    """Rank `rank`'s input: small integers (exact sums in any order) or random floats."""
    rng = np.random.default_rng([rank, count, len(case), sum(map(ord, case))])
    if dtype in ("float32-random", "float64-random"):
        return rng.standard_normal(count).astype(dtype.split("-")[0])
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    values = rng.integers(-8, 9, count)
    if dtype == "float32-nan" and count > 3:
        values = values.astype(np.float32)
        if rank == 1:
            values[3] = np.nan  # Max must propagate it whichever rank holds it
        return values
    return values.astype(dtype.split("-")[0])


REDUCE_CASES = [
    # (dtype, op, exact): exact cases compare bit for bit
    ("float32", ringplug.Sum, True),
    ("int32", ringplug.Sum, True),
    ("int64", ringplug.Max, True),
    ("float64", ringplug.Min, True),
    ("float16", ringplug.Sum, True),  # MPI cannot reduce it: doubling or ring only
    ("float32-nan", ringplug.Max, True),  # nor Max of floats
    ("bool", ringplug.Sum, True),
    ("float32-random", ringplug.Average, False),
    ("float64-random", ringplug.Sum, False),
]


def expected_reduction(arrays: list[np.ndarray], op) -> np.ndarray:
    wide = [a.astype(np.float64) if a.dtype == np.float16 else a for a in arrays]
    if op in (ringplug.Sum, ringplug.Average):
        if wide[0].dtype == bool:
            return np.logical_or.reduce(wide)
        total = np.sum(wide, axis=0, dtype=wide[0].dtype)
        return total / len(arrays) if op is ringplug.Average else total
    if op is ringplug.Max:
        return np.maximum.reduce(wide)
    return np.minimum.reduce(wide)


def agrees(got: np.ndarray, want: np.ndarray, exact: bool) -> tuple[bool, str]:
    want = want.astype(got.dtype)
    if got.shape != want.shape:
        return False, f"shape {got.shape}, expected {want.shape}"
    if exact:
        same = np.array_equal(got, want, equal_nan=got.dtype.kind == "f")
        return same, "" if same else f"first values {got[:4]} expected {want[:4]}"
    close = np.allclose(got, want, rtol=1e-5, atol=1e-5)
    return close, "" if close else f"max error {np.max(np.abs(got - want))}"


def force(kind: str, algorithm: str) -> None:
    """Every rank: this algorithm for `kind` at every size (the rest fixed)."""
    engine = runtime.engine()
    table = fixed_table(engine.size, 1 << 20).forcing({kind: algorithm})
    engine.transport.use_algorithms(table)


def recorder(report: dict[str, dict]) -> Callable[[str, Callable[[], tuple]], None]:
    """``record(name, check)``: `check()`'s (ok, detail) in `report`, with the path the
    engine's transport took (a check that raises is a failure with its traceback)."""
    engine = runtime.engine()

    def record(name: str, check: Callable[[], tuple]) -> None:
        try:
            ok, detail = check()
        except Exception:  # noqa: BLE001 - the report names it
            ok, detail = False, traceback.format_exc(limit=4)
        report[name] = {"ok": bool(ok), "path": engine.transport.last_path, "detail": detail}

    return record


def allreduce_cases(record, rank: int, size: int, prefix: str, sizes=SIZES) -> None:
    """Every case of `REDUCE_CASES` at each of `sizes`, then three tensors at once (fused;
    the ring takes them in place as pieces), against numpy, named under `prefix`."""
    for dtype, op, exact in REDUCE_CASES:
        for count in sizes:
            name = f"{prefix}/{dtype}/{op.name}/{count}"

            def check(dtype=dtype, op=op, exact=exact, count=count, name=name):
                send = inputs(rank, count, dtype, name)
                got = ringplug.allreduce(send, op=op, name=name)
                everyone = [inputs(r, count, dtype, name) for r in range(size)]
                return agrees(np.asarray(got), expected_reduction(everyone, op), exact)

            record(name, check)
    name = f"{prefix}/grouped"

    def grouped():
        counts = (5, 3000, 20_000)
        sends = [inputs(rank, n, "float32", f"{name}{n}") for n in counts]
        got = ringplug.grouped_allreduce(sends, op=ringplug.Sum, name=name)
        for n, result in zip(counts, got, strict=True):
            everyone = [inputs(r, n, "float32", f"{name}{n}") for r in range(size)]
            ok, detail = agrees(
                np.asarray(result), expected_reduction(everyone, ringplug.Sum), True
            )
            if not ok:
                return ok, f"{n}: {detail}"
        return True, ""

    record(name, grouped)


def run_cases(rank: int, size: int) -> dict[str, dict]:
    report: dict[str, dict] = {}
    engine = runtime.engine()
    record = recorder(report)
    for algorithm in CANDIDATES[(ALLREDUCE, True)]:
        if algorithm == HIERARCHICAL and not engine.transport.spans_hosts():
            continue  # one host: tests/workers/hierarchical.py runs it on several
        force(ALLREDUCE, algorithm)
        allreduce_cases(record, rank, size, f"allreduce/{algorithm}")

    for algorithm in CANDIDATES[(REDUCESCATTER, True)]:
        force(REDUCESCATTER, algorithm)
        for dtype, op, exact in REDUCE_CASES[:6]:
            for rows in (size, 3 * size + 1, 5001):
                name = f"reducescatter/{algorithm}/{dtype}/{op.name}/{rows}"

                def check(dtype=dtype, op=op, exact=exact, rows=rows, name=name):
                    shape = (rows, 3)
                    send = inputs(rank, rows * 3, dtype, name).reshape(shape)
                    got = np.asarray(ringplug.reducescatter(send, op=op, name=name))
                    everyone = [
                        inputs(r, rows * 3, dtype, name).reshape(shape) for r in range(size)
                    ]
                    whole = expected_reduction(everyone, op)
                    # Earlier ranks get one row more when the rows do not divide.
                    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
                    start = sum(counts[:rank])
                    return agrees(got, whole[start : start + counts[rank]], exact)

                record(name, check)

    for algorithm in CANDIDATES[(ALLGATHER, True)]:
        force(ALLGATHER, algorithm)
        for per_rank in (1, 100, 30_000):
            name = f"allgather/{algorithm}/{per_rank}"

            def check(per_rank=per_rank, name=name):
                def part(r: int) -> np.ndarray:  # uneven: rank r has per_rank + r rows
                    return inputs(r, (per_rank + r) * 2, "float32-random", name).reshape(-1, 2)

                got = np.asarray(ringplug.allgather(part(rank), name=name))
                return agrees(got, np.concatenate([part(r) for r in range(size)]), True)

            record(name, check)

    for algorithm in CANDIDATES[(BROADCAST, True)]:
        force(BROADCAST, algorithm)
        for count in SIZES:
            for root in sorted({0, size - 1}):
                name = f"broadcast/{algorithm}/{count}/root{root}"

                def check(count=count, root=root, name=name):
                    send = inputs(rank, count, "float64-random", name)
                    got = np.asarray(ringplug.broadcast(send, root_rank=root, name=name))
                    return agrees(got, inputs(root, count, "float64-random", name), True)

                record(name, check)
    return report


def main() -> None:
    outdir = Path(sys.argv[1])
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    engine = runtime.engine()
    # The first collective makes the job's table: measured (RINGPLUG_CALIBRATION=fresh).
    ringplug.allreduce(np.ones(4, np.float32), name="first")
    measured = engine.transport.algorithms
    # A second communicator on the same ranks: rank 0 finds the table in the cache.
    from mpi4py import MPI

    second = Transport(MPI.COMM_WORLD, replace(runtime.settings(), calibration="auto"))
    cached = second.algorithms
    # No time at all: one size measured, too few to fit.
    no_time = calibration.measure(second, 0.0)
    second.free()
    # The hierarchical allreduce forced on ranks of one host: refused on every rank.
    forced = Transport(MPI.COMM_WORLD, replace(runtime.settings(), algorithm="hierarchical"))
    try:
        refused = f"no error; table {forced.algorithms.to_json()}"
    except ValueError as error:
        refused = str(error)
    forced.free()
    cases = run_cases(rank, size)
    # A process set's engine measures its own table at its first collective (fresh).
    subset = ringplug.add_process_set(range(size - 1)) if size >= 3 else None
    set_table = None
    if subset is not None and subset.included():
        total = subset.allreduce(np.ones(1000, np.float32), op=ringplug.Sum, name="set-first")
        cases["process-set/first-allreduce"] = {
            "ok": bool(np.all(np.asarray(total) == size - 1)),
            "path": subset._member_engine("test").transport.last_path,
            "detail": f"{np.asarray(total)[:3]}",
        }
        set_table = subset._member_engine("test").transport.algorithms.to_json()
    report = {
        "cases": cases,
        "set_table": set_table,
        "table": measured.to_json(),
        "cached": cached.to_json(),
        "deadline": no_time.to_json(),
        "refused": refused,
    }
    (outdir / f"algorithms-{rank}.json").write_text(json.dumps(report))
    ringplug.shutdown()


if __name__ == "__main__":
    main()
