"""Multi-rank worker: report what ringplug.init() learned about this rank's place."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ringplug


def main(outdir: Path) -> None:
    ringplug.init()
    ringplug.init()  # idempotent
    facts = {
        "rank": ringplug.rank(),
        "size": ringplug.size(),
        "local_rank": ringplug.local_rank(),
        "local_size": ringplug.local_size(),
        "cross_rank": ringplug.cross_rank(),
        "cross_size": ringplug.cross_size(),
        "everyone": ringplug.allgather_object(ringplug.rank()),
    }
    ringplug.shutdown()
    facts["after_shutdown"] = ringplug.is_initialized()
    ringplug.init()  # rejoin after shutdown
    facts["rejoined_sum"] = int(ringplug.allreduce(__import__("numpy").ones(1), op="sum")[0])
    (outdir / f"topology-{facts['rank']}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
