"""Multi-rank worker: one rank fails in a chosen way while the others wait in a collective.

``python failures.py SCENARIO MARKER``; MARKER only rides along in argv so the test can
look for leftover processes. Scenarios:
  exception  rank 1 raises after a few collectives
  kill       rank 1 SIGKILLs itself after a few collectives
  absent     rank 1 never arrives (blocks forever outside ringplug); RINGPLUG_TIMEOUT ends it
  exception-after-gloo  as exception, with a torch.distributed gloo group running
  absent-captured  as absent, with file descriptors 1 and 2 going nowhere, as under
                   pytest's capture: nothing a rank prints reaches ringrun
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import numpy as np

import ringplug


def main(scenario: str) -> None:
    if scenario.endswith("-captured"):
        sink = os.open(os.devnull, os.O_WRONLY)
        os.dup2(sink, 1)
        os.dup2(sink, 2)
        scenario = scenario.removesuffix("-captured")
    ringplug.init()
    if scenario == "exception-after-gloo":
        # torch.distributed wraps sys.excepthook and buffers what the hooks print.
        from ringplug.torch.process_group import init_gloo_group

        init_gloo_group()
        scenario = "exception"
    rank = ringplug.rank()
    buf = np.ones(1000, np.float32)
    for _ in range(3):
        ringplug.allreduce(buf, op=ringplug.Sum, out=buf)
    print(f"rank {rank} finished the warm-up collectives", flush=True)
    if rank == 1:
        if scenario == "exception":
            raise RuntimeError("boom: rank 1 failed on purpose")
        if scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "absent":
            threading.Event().wait()  # never returns: this rank is stuck elsewhere
    # The other ranks go on into a collective that rank 1 never joins.
    while True:
        ringplug.allreduce(buf, op=ringplug.Sum, out=buf, name="stuck")


if __name__ == "__main__":
    main(sys.argv[1])
