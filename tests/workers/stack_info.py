"""Multi-rank worker: what each rank runs on, and proof that the ranks talk.

``python stack_info.py OUTDIR [VARIABLE ...]`` writes OUTDIR/info-<rank>.json: rank and
size, the interpreter's version, the MPI library mpi4py loaded, the CPUs the rank may run
on, the values of the named environment variables, and the result of an allreduce.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import ringplug


def main(outdir: str, names: list[str]) -> None:
    ringplug.init()
    from mpi4py import MPI

    rank = ringplug.rank()
    values = np.full(3, rank + 1.0)
    ringplug.allreduce(values, op=ringplug.Sum, out=values)
    report = {
        "rank": rank,
        "size": ringplug.size(),
        "python": list(sys.version_info[:2]),
        "executable": sys.executable,
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "cpus": sorted(os.sched_getaffinity(0)),
        "env": {name: os.environ.get(name) for name in names},
        "sum": values.tolist(),
    }
    (Path(outdir) / f"info-{rank}.json").write_text(json.dumps(report))
    ringplug.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
