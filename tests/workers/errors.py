"""Multi-rank worker: bad calls raise the same error on every rank, and nothing hangs.

Each scenario catches what ringplug raised; after all of them a correct allreduce must
still work, which shows the ranks stayed in step. Writes OUTDIR/errors-<rank>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import ringplug


def scenarios(rank: int, size: int):
    """(name, callable) pairs; each callable is this rank's side of one bad call."""
    yield "shape", lambda: ringplug.allreduce(np.ones(4 + rank, np.float32), name="grad/w")
    yield "shape-large", lambda: ringplug.allreduce(np.ones(1_000_000 + rank, np.float32))
    yield (
        "dtype",
        lambda: ringplug.allreduce(
            np.ones(8, np.float32 if rank == 0 else np.float64), op=ringplug.Sum
        ),
    )
    yield (
        "op",
        lambda: ringplug.allreduce(
            np.ones(8, np.float32), op=ringplug.Sum if rank == 0 else ringplug.Max
        ),
    )
    yield "root", lambda: ringplug.broadcast(np.ones(8), root_rank=min(rank, 1))
    yield (
        "kind",
        lambda: ringplug.allreduce(np.ones(8)) if rank == 0 else ringplug.broadcast(np.ones(8), 0),
    )
    yield "allgather-trailing", lambda: ringplug.allgather(np.ones((2, 3 + rank)))
    yield "root-out-of-range", lambda: ringplug.broadcast(np.ones(8), root_rank=size + 3)
    yield (
        "root-out-of-range-one-rank",
        lambda: ringplug.broadcast(np.ones(8), root_rank=size + 3 if rank == 1 else 0),
    )
    yield (
        "unsupported-dtype-one-rank",
        lambda: ringplug.allreduce(np.ones(8, np.complex64 if rank == 1 else np.float32)),
    )
    yield "integer-average", lambda: ringplug.allreduce(np.ones(8, np.int32))
    yield (
        "bad-splits-one-rank",
        lambda: ringplug.alltoall(
            np.ones((size * 2, 2)), splits=[5] * size if rank == 1 else [2] * size
        ),
    )
    yield (
        "unpicklable-on-root",
        lambda: ringplug.broadcast_object((lambda: None) if rank == 0 else None, root_rank=0),
    )
    yield "wrong-out", lambda: ringplug.allreduce(np.ones(8), out=np.ones(8 + rank))


def main(outdir: Path) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    seen = {}
    for name, call in scenarios(rank, size):
        try:
            call()
            seen[name] = {"type": None, "message": ""}
        except Exception as exc:  # noqa: BLE001 - recording what was raised is the point
            seen[name] = {"type": type(exc).__name__, "message": str(exc)}
    total = ringplug.allreduce(np.full(1000, rank + 1.0), op=ringplug.Sum)
    seen["after"] = {"ok": bool(np.all(total == size * (size + 1) / 2))}
    (outdir / f"errors-{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
