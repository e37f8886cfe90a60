"""Multi-rank worker: the O(log p) control plane and small allreduces on any number of ranks.

``python scale.py OUTDIR [--stall]``: each rank
- counts, by the engine's own counters, the messages and bytes of training-like steps of 8
  named 4 KiB allreduces (submitted together, then waited for) and of a lone synchronous
  4 KiB allreduce, once their names are agreed;
- checks small allreduces that take recursive doubling (16-bit floats, Max and Min of
  floats) against numpy, and that every rank got the same bits;
- submits a tensor whose shape differs on the last rank and keeps the error;
- joins after a number of batches that differs by rank;
- with ``--stall``, waits for a tensor that one rank never submits (the stall inspector);
and writes OUTDIR/scale-<rank>.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ringplug
import ringplug.core.runtime
from ringplug.core.dtypes import bfloat16_to_float32, float32_to_bfloat16
from ringplug.core.transport.traffic import difference

STEPS = 5
TENSORS = 8
ELEMENTS = 1024  # 4 KiB of float32


def step(grads: list[np.ndarray], rank: int) -> None:
    """One training-like step: 8 gradients (rank 0's ones, the others' zeros) summed."""
    for g in grads:
        g[...] = 1.0 if rank == 0 else 0.0
    handles = [
        ringplug.allreduce_async(g, op=ringplug.Sum, out=g, name=f"grad.{i}")
        for i, g in enumerate(grads)
    ]
    for handle in handles:
        ringplug.synchronize(handle)


def per_step(run, steps: int, profiled: bool = False) -> dict:
    """The engine's traffic and cycles per call of `run`, over `steps` calls; `profiled`:
    inside MPI_Pcontrol(1) and MPI_Pcontrol(0), the window of an MPI profiling library
    (tests/pmpi/count_sends.c; without one, MPI_Pcontrol does nothing)."""
    engine = ringplug.core.runtime.engine()
    before, cycles = engine.traffic.snapshot(), engine.counters.cycles_run
    agreed = engine.exchange.agreed_cycles
    if profiled:
        # Called beside the engine thread, which is idle here (every handle is done) and
        # only probes; the profiling library's MPI_Pcontrol calls no MPI function then.
        MPI.Pcontrol(1)
    for _ in range(steps):
        run()
    if profiled:
        MPI.Pcontrol(0)
    counts = difference(engine.traffic.snapshot(), before)
    return {
        "cycles": (engine.counters.cycles_run - cycles) / steps,
        # of those, cycles whose messages the ranks found alike without gathering them
        "agreed": (engine.exchange.agreed_cycles - agreed) / steps,
        "messages": {k: v / steps for k, v in counts["messages"].items()},
        "bytes": {k: v / steps for k, v in counts["bytes"].items()},
        "collectives": {k: v / steps for k, v in counts["collectives"].items()},
    }


def small_allreduces(rank: int, size: int) -> tuple[dict, str]:
    """name -> (path taken, whether it matches numpy), and a digest of the random sums."""
    engine = ringplug.core.runtime.engine()
    rng = np.random.default_rng(1234)  # the same numbers on every rank: each takes its row
    cases = {}
    digest = hashlib.sha256()
    for dtype in ("float16", "bfloat16", "float32"):
        for op in ("sum", "max", "min"):
            for length in (1, 7, 1000):
                table = rng.integers(-8, 9, (size, length))  # exact in every dtype
                if op != "sum" and length > 1:
                    table = table.astype(np.float64)
                    table[(length * 7) % size, length // 2] = np.nan  # Max and Min keep NaN
                values = _array(table[rank], dtype)
                ringplug.allreduce(
                    values, op=op, out=values, name=f"{dtype}/{op}/{length}", dtype=_as(dtype)
                )
                expected = {"sum": np.sum, "max": np.max, "min": np.min}[op](table, axis=0)
                got = _as_float(values, dtype)
                cases[f"{dtype}/{op}/{length}"] = {
                    "path": engine.transport.last_path,
                    "ok": bool(np.array_equal(got, expected, equal_nan=True)),
                }
    for op in ("sum", "max"):
        # A small reduce-scatter MPI cannot reduce: recursive doubling, then this rank's
        # rows (rows split as evenly as they go; the first ranks get one more).
        rows = 2 * size + 1
        table = rng.integers(-8, 9, (size, rows, 3))
        block = ringplug.reducescatter(table[rank].astype(np.float16), op=op)
        full = {"sum": np.sum, "max": np.max}[op](table, axis=0)
        base, extra = divmod(rows, size)
        start = rank * base + min(rank, extra)
        mine = full[start : start + base + (1 if rank < extra else 0)]
        cases[f"reducescatter/float16/{op}"] = {
            "path": engine.transport.last_path,
            "ok": bool(np.array_equal(np.asarray(block, np.float64), mine)),
        }
    for dtype in ("float16", "bfloat16"):
        noise = _array(rng.standard_normal((size, 333))[rank], dtype)
        ringplug.allreduce(noise, op="sum", out=noise, name=f"{dtype}/noise", dtype=_as(dtype))
        digest.update(np.asarray(noise).tobytes())
    return cases, digest.hexdigest()


def _array(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` in `dtype`; bfloat16 as raw 16-bit words."""
    if dtype == "bfloat16":
        words = np.empty(values.shape, np.uint16)
        return float32_to_bfloat16(values.astype(np.float32), words)
    return values.astype(dtype)


def _as(dtype: str) -> str | None:
    return "bfloat16" if dtype == "bfloat16" else None


def _as_float(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bfloat16_to_float32(values).astype(np.float64)
    return np.asarray(values, np.float64)


def mismatch(rank: int, size: int) -> str:
    """The error of an allreduce whose shape differs on the last rank."""
    shape = 4 if rank == size - 1 else 3
    try:
        ringplug.allreduce(np.ones(shape, np.float32), name="differs")
    except ringplug.core.errors.RingplugError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def main(outdir: Path, stall: bool = False) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    grads = [np.empty(ELEMENTS, np.float32) for _ in range(TENSORS)]
    lone = np.empty(ELEMENTS, np.float32)

    def sum_lone() -> None:
        lone[...] = 1.0 if rank == 0 else 0.0
        ringplug.allreduce(lone, op=ringplug.Sum, out=lone, name="lone")

    for _ in range(3):  # the names are agreed (cached) from here on
        step(grads, rank)
        sum_lone()
    report = {
        "rank": rank,
        "size": size,
        "step": per_step(lambda: step(grads, rank), STEPS, profiled=True),
        "lone": per_step(sum_lone, STEPS),
    }
    report["ok"] = bool(all(np.all(g == 1.0) for g in grads) and np.all(lone == 1.0))
    report["doubling"], report["digest"] = small_allreduces(rank, size)
    report["mismatch"] = mismatch(rank, size)
    report["join"] = join(rank)
    if stall:
        report["stall"] = stalled(rank)  # last: the stall ends the engine
    (outdir / f"scale-{rank}.json").write_text(json.dumps(report))
    ringplug.shutdown()


def join(rank: int) -> dict:
    """Rank r has r % 3 + 1 batches of a sum, then joins; the last to join is the highest
    rank with 3 batches."""
    sums = []
    for _batch in range(rank % 3 + 1):
        sums.append(ringplug.allreduce(np.full(2, 1.0), op="sum", name="joined-sum").tolist())
    last = ringplug.join()
    after = ringplug.allreduce(np.ones(2), op="sum", name="after-join").tolist()
    return {"sums": sums, "last": last, "after": after}


def stalled(rank: int) -> dict:
    """Every rank but the last submits 'everyone-but-the-last'; the last rank submits
    'only-the-last': the stall inspector names who lacks what, then ends both."""
    size = ringplug.size()
    name = "only-the-last" if rank == size - 1 else "everyone-but-the-last"
    handle = ringplug.allreduce_async(np.ones(4), name=name)
    try:
        handle.wait(timeout=120)
    except ringplug.core.errors.RingplugError as exc:
        return {"type": type(exc).__name__, "error": str(exc)}
    return {"type": None, "error": ""}


if __name__ == "__main__":
    main(Path(sys.argv[1]), stall="--stall" in sys.argv[2:])
