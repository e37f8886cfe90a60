"""Multi-rank worker: the stall inspector says what the missing rank was doing.

``python diagnose_stall.py`` on 2 ranks, with a short RINGPLUG_STALL_CHECK_SECONDS. Each
scenario leaves rank 0 waiting in a collective named after it while rank 1 is held (by a
planted sleep) somewhere else: in its data loader, in forward/backward, in a different
collective, or done with its data. Rank 0's stall warnings (stderr) are what the test reads.
"""

from __future__ import annotations

import time

import numpy as np

import ringplug
from ringplug.diagnose import StepClock

HELD_S = 2.5  # planted: well past the 0.5 s stall check, far below RINGPLUG_TIMEOUT


def slow_batches(count: int):
    for index in range(count):
        if ringplug.rank() == 1 and index == 1:
            time.sleep(HELD_S)  # rank 1's loader stalls on its second batch
        yield np.ones(4, np.float32)


def main() -> None:
    ringplug.init()
    rank = ringplug.rank()
    clock = StepClock(print_table=False)
    clock.start()
    # In its data loader: rank 1's second fetch sleeps; rank 0 waits in the reduction.
    for index, batch in enumerate(clock.batches(slow_batches(2))):
        ringplug.allreduce(batch, name=f"stall.data.{index}")
    # In forward/backward: rank 1 has its batch and sleeps before submitting.
    for batch in clock.batches(slow_batches(1)):
        if rank == 1:
            time.sleep(HELD_S)
        ringplug.allreduce(batch, name="stall.compute")
    # In a different collective: rank 1 submits another one first and waits in it.
    if rank == 1:
        other = ringplug.allreduce_async(np.ones(4, np.float32), name="stall.other")
        time.sleep(HELD_S)
        ringplug.allreduce(np.ones(4, np.float32), name="stall.different")
        other.wait()
    else:
        ringplug.allreduce(np.ones(4, np.float32), name="stall.different")
        ringplug.allreduce(np.ones(4, np.float32), name="stall.other")
    # Done with its data: rank 1's loader ran out; it lingers before the last reduction.
    for _ in clock.batches(slow_batches(0)):
        pass
    if rank == 1:
        time.sleep(HELD_S)
    ringplug.allreduce(np.ones(4, np.float32), name="stall.finished")
    clock.finish()


if __name__ == "__main__":
    main()
