"""Multi-rank worker for ringrun's elastic restarts: `python elastic.py DIR SCENARIO MARKER`.

Every rank prints which start it is in (RINGPLUG_RESTART) and its world, then runs 20
allreduce steps; a rank that ends them writes DIR/done.<restart>.<rank>. Planted faults:

  kill        rank 2 of the first start SIGKILLs itself at step 5
  kill-twice  the same, and rank 0 of the first restart exits with code 5 at step 2
  always      rank 1 exits with code 7 at step 3 in every start
  preempt     every rank writes DIR/running.<rank>, then waits; on SIGTERM it "saves a
              checkpoint" (writes DIR/saved.<rank>) and exits with 143
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np

import ringplug


def main(folder: Path, scenario: str) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    restart = int(os.environ["RINGPLUG_RESTART"])
    print(f"start {restart}: rank {rank} of {size}", flush=True)
    if scenario == "preempt":
        saved = threading.Event()

        def save(signum, frame):
            (folder / f"saved.{rank}").write_text(str(restart))
            saved.set()

        signal.signal(signal.SIGTERM, save)
        (folder / f"running.{rank}").write_text("")
        saved.wait(120)
        os._exit(143)
    x = np.ones(4, np.float32)
    for step in range(20):
        if scenario in ("kill", "kill-twice") and restart == 0 and rank == 2 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "kill-twice" and restart == 1 and rank == 0 and step == 2:
            sys.exit(5)
        if scenario == "always" and rank == 1 and step == 3:
            sys.exit(7)
        ringplug.allreduce(x, op=ringplug.Sum, out=x, name="step")
    (folder / f"done.{restart}.{rank}").write_text(str(size))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
