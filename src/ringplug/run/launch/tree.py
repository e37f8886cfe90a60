"""Ending every process a rank started: its children, theirs, and those that left its group.

The ranks run in a process group of their own (so that ringrun's SIGUSR1 for ``--stacks``
does not reach them), and a program may start helpers that leave even that group (a
server started with ``start_new_session=True``, a daemon that double-forks). Nothing else
ends them: without this, a failed job left them running, re-parented to init, holding GPU
memory, ports and files.

So the rank's wrapper keeps them: on Linux it is a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so a process whose parent exits is re-parented to the wrapper
instead of to init, and every process the rank started stays under the wrapper in
``/proc``, whatever group or session it moved to. When the program has ended,
`end_descendants` sends SIGTERM to every process left under the wrapper, SIGKILL to those
still there after a grace period, and returns the ones that outlive even that, for the
wrapper to name. Without ``/proc`` (macOS) only the program's process group can be reached.

Standard library only: the wrapper imports it inside every rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ringplug.forensics.stacks import child_pids, process_state

TERMINATE_GRACE_S = 2.0
"""How long the processes left after the program get between SIGTERM and SIGKILL: a server
closes its sockets, a writer flushes its file. Short, because the job has ended: with the
SIGKILL wait, every process is gone or named well within 10 s of the program's end."""

KILL_WAIT_S = 1.0
"""How long processes get to vanish after SIGKILL before they are named as survivors (one in
uninterruptible sleep, on a hung disk or driver, cannot die until its call returns)."""

_POLL_S = 0.02


@dataclass(frozen=True)
class Survivor:
    """A process the rank started that was still there after SIGKILL.

    Args:
        pid: its process id (negative: a whole process group, where ``/proc`` is missing).
        command: its command line, as ``/proc`` shows it ("" where unknown).
        state: its state in words (``in uninterruptible sleep (disk or swap)``).
    """

    pid: int
    command: str
    state: str

    def describe(self) -> str:
        """``process 123 (sleep 300), in uninterruptible sleep (disk or swap)``."""
        what = f"process group {-self.pid}" if self.pid < 0 else f"process {self.pid}"
        command = f" ({self.command})" if self.command else ""
        state = f", {self.state}" if self.state else ""
        return f"{what}{command}{state}"

    @property
    def kill_command(self) -> str:
        return f"kill -9 -- {self.pid}"


def _proc_available() -> bool:
    return Path(f"/proc/{os.getpid()}/task").is_dir()


def _children_by_parent() -> dict[int, list[int]]:
    """Every process's children, read from each ``/proc/PID/stat`` (for kernels without
    ``/proc/PID/task/TID/children``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rfind(")") + 2 :].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    return children


def descendants(root: int, children_files: bool | None = None) -> list[int]:
    """Every process under `root` (children, theirs, ...), zombies included, from ``/proc``:
    through each thread's ``children`` file, or where the kernel has none (or
    `children_files` is False) from every process's parent."""
    if children_files is None:
        children_files = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()
    table = None if children_files else _children_by_parent()
    found: list[int] = []
    seen = {root}
    pending = [root]
    while pending:
        pid = pending.pop()
        kids = child_pids(pid) if table is None else table.get(pid, [])
        for kid in kids:
            if kid not in seen:
                seen.add(kid)
                found.append(kid)
                pending.append(kid)
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has ended: it holds no memory, files or ports)."""
    state = process_state(pid)
    return state != "gone" and not state.startswith(("a zombie", "dead"))


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_children() -> None:
    """Collect the exit status of this process's children that ended (the orphans it adopted
    as subreaper among them), so that they leave the process table."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    return text if len(text) <= 120 else text[:117] + "..."


def end_descendants(
    root: int,
    group: int | None = None,
    grace_s: float = TERMINATE_GRACE_S,
    kill_wait_s: float = KILL_WAIT_S,
    hurry: Callable[[], bool] = lambda: False,
    send: Callable[[int, int], None] = os.kill,
) -> list[Survivor]:
    """End every process under `root`: SIGTERM, then SIGKILL after `grace_s`; return those
    still running `kill_wait_s` after SIGKILL.

    Call it from `root` itself, once the program (its child) has been waited for: it reaps
    `root`'s children as they end. Processes started meanwhile (a helper forking while its
    siblings die) are found on the next look and get the same treatment.

    Args:
        root: the process whose descendants to end; itself is left alone.
        group: the program's process group, used where ``/proc`` is missing (there the
            descendants cannot be listed). Defaults to ``None``.
        grace_s: time between SIGTERM and SIGKILL. Defaults to `TERMINATE_GRACE_S`.
        kill_wait_s: time after SIGKILL before a process counts as a survivor. Defaults
            to `KILL_WAIT_S`.
        hurry: asked at every look; once it says True, the grace period ends (the
            wrapper's own launcher is gone, so the teardown is in its last stage).
        send: how a signal is sent, ``os.kill``'s signature (a negative pid is a group).
    """
    use_proc = _proc_available()
    terminate_by = time.monotonic() + grace_s
    kill_by: float | None = None
    terminated: set[int] = set()
    while True:
        if root == os.getpid():
            _reap_children()
        if use_proc:
            left = [pid for pid in descendants(root) if _alive(pid)]
        else:
            left = [-group] if group is not None and _group_alive(group) else []
        if not left:
            return []
        now = time.monotonic()
        if kill_by is None and (hurry() or now >= terminate_by):
            kill_by = now + kill_wait_s
        if kill_by is not None and now >= kill_by:
            return [
                Survivor(pid, _command_line(pid), process_state(pid) if pid > 0 else "")
                for pid in left
            ]
        for pid in left:
            if kill_by is not None or pid not in terminated:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    send(pid, signal.SIGKILL if kill_by is not None else signal.SIGTERM)
                terminated.add(pid)
        time.sleep(_POLL_S)
