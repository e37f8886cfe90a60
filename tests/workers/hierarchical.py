"""Multi-rank worker: the hierarchical allreduce, forced by ``RINGPLUG_ALGORITHM``, against
numpy on every dtype and op of tests/workers/algorithms.py, and the table measured on the
same ranks.

Run as ``ringrun -H a:2,b:2 python tests/workers/hierarchical.py OUTDIR [measure]`` (or on
one machine with the test-only ``RINGPLUG_TEST_RANKS_PER_HOST``) with
``RINGPLUG_ALGORITHM=allreduce=hierarchical``; each rank writes OUTDIR/hierarchical-<rank>.json:

- "hosts": each rank's host as the transport sees it;
- "columns": whether the hierarchy has a column communicator (hosts of equal size), so
  that its large cases took the columns' form;
- "cases": {case: {"ok", "path", "detail"}}: each dtype, op and size, and a grouped call;
- "table": with ``measure``, the table of a second communicator of the same ranks,
  measured there (`RINGPLUG_CALIBRATION=fresh`, nothing forced); else None.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from algorithms import allreduce_cases, recorder

import ringplug
from ringplug.core import runtime
from ringplug.core.transport.host import Transport

SIZES = (1, 7, 1000, 40_003, 300_001)  # elements; 300,001 x 4 bytes: the leaders' ring


def run_cases(rank: int, size: int) -> dict[str, dict]:
    report: dict[str, dict] = {}
    allreduce_cases(recorder(report), rank, size, "allreduce", SIZES)
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
    hierarchy = engine.transport._hierarchy
    report = {
        "hosts": engine.transport.hosts(),
        "cases": cases,
        "table": table,
        # Hosts of equal size: large buffers went by columns (every rank across the hosts).
        "columns": hierarchy is not None and hierarchy.column is not None,
    }
    (outdir / f"hierarchical-{rank}.json").write_text(json.dumps(report))
    ringplug.shutdown()


if __name__ == "__main__":
    main()
