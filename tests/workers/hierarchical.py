"""Multi-rank worker: the hierarchical allreduce, forced by ``RINGPLUG_ALGORITHM``, against
numpy on every dtype and op of tests/workers/algorithms.py, and the table measured on the
same ranks.

Run as ``ringrun -H a:2,b:2 python tests/workers/hierarchical.py OUTDIR [measure]`` (or on
one machine with the test-only ``RINGPLUG_TEST_RANKS_PER_HOST``) with
``RINGPLUG_ALGORITHM=allreduce=hierarchical``; each rank writes OUTDIR/hierarchical-<rank>.json:

- "hosts": each rank's host as the transport sees it;
- "cases": {case: {"ok", "path", "detail"}}: each dtype, op and size, and a grouped call;
- "table": with ``measure``, the table of a second communicator of the same ranks,
  measured there (`RINGPLUG_CALIBRATION=fresh`, nothing forced); else None.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
from algorithms import REDUCE_CASES, agrees, expected_reduction, inputs

import ringplug
from ringplug.core import runtime
from ringplug.core.transport.host import Transport

SIZES = (1, 7, 1000, 40_003, 300_001)  # elements; 300,001 x 4 bytes: the leaders' ring


def run_cases(rank: int, size: int) -> dict[str, dict]:
    engine = runtime.engine()
    report: dict[str, dict] = {}

    def record(name: str, check) -> None:
        try:
            ok, detail = check()
        except Exception:  # noqa: BLE001 - the report names it
            ok, detail = False, traceback.format_exc(limit=4)
        report[name] = {"ok": bool(ok), "path": engine.transport.last_path, "detail": detail}

    for dtype, op, exact in REDUCE_CASES:
        for count in SIZES:
            name = f"allreduce/{dtype}/{op.name}/{count}"

            def check(dtype=dtype, op=op, exact=exact, count=count, name=name):
                send = inputs(rank, count, dtype, name)
                got = ringplug.allreduce(send, op=op, name=name)
                everyone = [inputs(r, count, dtype, name) for r in range(size)]
                return agrees(np.asarray(got), expected_reduction(everyone, op), exact)

            record(name, check)
    name = "allreduce/grouped"

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
    return report


def main() -> None:
    outdir = Path(sys.argv[1])
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    cases = run_cases(rank, size)
    engine = runtime.engine()
    from mpi4py import MPI

    table = None
    if sys.argv[2:] == ["measure"]:
        second = Transport(MPI.COMM_WORLD, replace(runtime.settings(), algorithm=None))
        table = second.algorithms.to_json()
        second.free()
    report = {"hosts": engine.transport.hosts(), "cases": cases, "table": table}
    (outdir / f"hierarchical-{rank}.json").write_text(json.dumps(report))
    ringplug.shutdown()


if __name__ == "__main__":
    main()
