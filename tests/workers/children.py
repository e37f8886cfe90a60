"""Multi-rank worker: each rank starts helper processes, then ends the way the test asks.

``python children.py FOLDER HOW [stubborn] [marker]``. Every rank starts, as a training script
starts a preprocessing helper, a TensorBoard or a server:

- a child in its process group (``sleep 300``);
- a child in a session of its own (``start_new_session=True``, as servers are started);
- an orphan in a session of its own, whose parent exited at once (a daemon's double fork);
- with ``stubborn``, a child that ignores SIGTERM.

It writes ``pid start-time`` of each to ``FOLDER/children.<start>.<rank>`` (``<start>``:
``RINGPLUG_RESTART``, 0 on the first start), then ends as HOW says:

- ``exit``: exits with code 0;
- ``block``: waits forever, for ringrun to be signalled;
- ``kill``: rank 2 SIGKILLs itself once every rank wrote its file; the others wait;
- ``restart``: on the first start as ``kill``; on a restart, checks that the helpers of the
  start before are gone (for at most 10 s), writes ``FOLDER/gone.<rank>`` saying so, and
  starts its own helpers as ``exit`` does;

No MPI: the ranks need none of it, and the job stays short. `record_helpers` serves workers
that do more (lightning_selflaunch.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

RANKS = 3
BOUND_S = 10.0


def start_time(pid: int) -> str:
    """The process's start time from ``/proc``: with the pid, it names one process for good."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2 :].split()[19]


def running(pid: int, start: str) -> bool:
    """Whether the process `pid` that started at `start` still runs (not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0] not in ("Z", "X") and fields[19] == start


def orphan_in_own_session() -> int:
    """Start ``sleep 300`` in a session of its own with a parent that exits at once."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:  # no thread runs in this process yet: forking is safe
        os.close(read)
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            os.execvp("sleep", ["sleep", "300"])
        os.write(write, str(grandchild).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        pid = int(pipe.read())
    os.waitpid(middle, 0)
    return pid


def start_helpers(stubborn: bool) -> list[int]:
    helpers = [
        subprocess.Popen(["sleep", "300"]).pid,
        subprocess.Popen(["sleep", "300"], start_new_session=True).pid,
        orphan_in_own_session(),
    ]
    if stubborn:
        helpers.append(ignoring_sigterm())
    return helpers


def ignoring_sigterm() -> int:
    """Start ``sleep 300`` ignoring SIGTERM; return once it runs (an ignored signal stays
    ignored across exec: once the shell became ``sleep``, the trap is set)."""
    pid = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 300"]).pid
    deadline = time.monotonic() + BOUND_S
    while Path(f"/proc/{pid}/cmdline").read_bytes() != b"sleep\x00300\x00":
        if time.monotonic() > deadline:
            raise SystemExit(f"the shell did not become sleep within {BOUND_S:g} s")
        time.sleep(0.01)
    return pid


def record_helpers(folder: Path, start: int, rank: int, stubborn: bool = False) -> None:
    """Start the helpers and write them to ``FOLDER/children.<start>.<rank>``."""
    helpers = start_helpers(stubborn)
    lines = "".join(f"{pid} {start_time(pid)}\n" for pid in helpers)
    write_atomically(folder / f"children.{start}.{rank}", lines)


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.rename(path)


def wait_for_every_rank(folder: Path, start: int) -> None:
    deadline = time.monotonic() + BOUND_S
    while len(list(folder.glob(f"children.{start}.?"))) < RANKS:
        if time.monotonic() > deadline:
            raise SystemExit(f"not every rank wrote its helpers within {BOUND_S:g} s")
        time.sleep(0.02)


def helpers_gone(folder: Path, start: int) -> bool:
    """Whether the helpers of every rank of `start` ended, waiting at most `BOUND_S`."""
    recorded = [
        line.split()
        for path in folder.glob(f"children.{start}.?")
        for line in path.read_text().splitlines()
    ]
    deadline = time.monotonic() + BOUND_S
    while any(running(int(pid), begun) for pid, begun in recorded):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main(folder: Path, how: str, stubborn: bool) -> None:
    rank = int(os.environ["RANK"])  # the wrapper sets it under every launcher
    start = int(os.environ.get("RINGPLUG_RESTART", "0"))
    if how == "restart" and start > 0:
        gone = helpers_gone(folder, start - 1)
        (folder / f"gone.{rank}").write_text("yes" if gone else "no")
        how = "exit"
    record_helpers(folder, start, rank, stubborn)
    if how == "exit":
        return
    if how in ("kill", "restart"):
        wait_for_every_rank(folder, start)
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], "stubborn" in sys.argv[3:])
