"""A 2-rank job whose rank 1 hangs in a planted function (`argv[1]` names which), while
rank 0 waits for it in an allreduce; the stall report must show the planted function.

Scenarios: sleep, deadlock (a threading.Lock acquired twice), regex (catastrophic
backtracking, which holds the interpreter lock), loader (a DataLoader worker that never
returns), sigstop (the rank stops itself), other (rank 1 waits in a different collective),
none (no hang: the stacks are asked for from outside while rank 1 waits on a file).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import ringplug


def planted_sleep() -> None:
    time.sleep(600)


LOCK = threading.Lock()


def planted_deadlock() -> None:
    with LOCK, LOCK:  # the same thread again: never returns
        pass


def planted_regex() -> None:
    # Exponential backtracking in C: the interpreter lock stays held throughout.
    re.match(r"(a+)+$", "a" * 64 + "b")


class HangingDataset:
    """Item 2 never comes back (in the worker process)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        if index == 2:
            planted_worker_hang()
        return np.full(2, index, np.float32)


def planted_worker_hang() -> None:
    time.sleep(600)


def planted_loader() -> None:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(HangingDataset(), batch_size=1, num_workers=1)
    for batch in loader:
        del batch


def planted_sigstop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def planted_other_collective() -> None:
    ringplug.allreduce(np.ones(4, np.float32), name="only-rank-1-calls-this")


def planted_wait_for_file() -> None:
    """Waits (bounded) until the test says it has the stacks."""
    done = Path(os.environ["HANGS_DONE_FILE"])
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


PLANTED = {
    "sleep": planted_sleep,
    "deadlock": planted_deadlock,
    "regex": planted_regex,
    "loader": planted_loader,
    "sigstop": planted_sigstop,
    "other": planted_other_collective,
    "none": planted_wait_for_file,
}


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "loader":
        import torch.utils.data  # noqa: F401 - before the stall check starts counting
    ringplug.init()
    for step in range(3):
        ringplug.allreduce(np.ones(4, np.float32), name=f"grads.{step}")
    print(f"rank {ringplug.rank()} ready", flush=True)
    if ringplug.rank() == 1:
        PLANTED[scenario]()
    ringplug.allreduce(np.ones(4, np.float32), name="after")
    print(f"rank {ringplug.rank()} done", flush=True)


if __name__ == "__main__":
    main()
