"""Process and output helpers shared by ringrun, its per-rank wrapper and the adapters.

The rank the launcher gave a process, a child that dies with its parent, output read in
whole lines, and writes that survive a closed terminal. Standard library only: the wrapper
imports this inside every rank, and the framework adapters (Lightning's self-launch) use
the parent-death signal without importing the wrapper.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
from collections.abc import Callable, Mapping
from typing import BinaryIO

# Checked in this order: MPICH/hydra (and Intel MPI), Open MPI, any PMIx launcher, Slurm.
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# How long a line without its newline is held back before it is shown anyway.
_PARTIAL_LINE_S = 0.2


def rank_from_environment(environ: Mapping[str, str]) -> int | None:
    """This process's rank as the launcher announced it, or ``None`` if none did."""
    for name in RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def framework_rank_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` from what the MPI launcher announced
    (empty when it announced no rank): the names torch, Lightning's ``rank_zero_only``,
    torchmetrics and logging libraries read for the rank, from their first import on.

    ``GROUP_RANK`` and ``LOCAL_WORLD_SIZE`` stay unset: with them, Lightning would take the
    job for one that torchrun started (its ``TorchElasticEnvironment``).
    """
    rank, size = rank_from_environment(environ), size_from_environment(environ)
    if rank is None or size is None:
        return {}
    variables = {"RANK": str(rank), "WORLD_SIZE": str(size)}
    for name in LOCAL_RANK_VARIABLES:
        if environ.get(name, "").isdigit():
            variables["LOCAL_RANK"] = environ[name]
            break
    return variables


def size_from_environment(environ: Mapping[str, str]) -> int | None:
    """The job's size as the launcher announced it, or ``None`` if none did."""
    for name in SIZE_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or ``None`` where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A function that asks Linux to send ``sig`` to the calling process when its parent dies.

    For ``subprocess.Popen(preexec_fn=...)``: the child dies with the process that started
    it. Returns ``None`` where ``prctl`` does not exist (not Linux); there the caller still
    works, it just cannot guarantee cleanup if it is SIGKILLed itself.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        # The parent may have died between fork and prctl; then no signal would ever come.
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return set_death_signal


def die_with_parent() -> None:
    """Make the calling process get SIGKILL when its parent dies, and die now if it has."""
    prctl = _prctl()
    if prctl is None:
        return
    parent = os.getppid()
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def become_subreaper() -> bool:
    """Make orphaned descendants of this process re-parent to it instead of to init.

    Returns whether it worked (Linux 3.4 and later); elsewhere the processes that leave the
    program's process group cannot be found once their parent exits.
    """
    prctl = _prctl()
    if prctl is None:
        return False
    return prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def pump_lines(
    source: BinaryIO,
    on_line: Callable[[bytes], None],
    on_chunk: Callable[[bytes], None] | None = None,
) -> None:
    """Read `source` to its end, handing each complete line (ended by ``\n`` or ``\r``) to
    `on_line` at once and a partial one (a prompt, a progress bar) after at most
    ``_PARTIAL_LINE_S`` of quiet; every raw chunk also goes to `on_chunk`. Closes `source`.
    """
    fd = source.fileno()
    # The unfinished line grows in place (a bytearray appends in amortised constant time)
    # and only the newly read bytes are searched for line ends: relaying costs time linear
    # in the bytes, however long a line is (concatenating bytes copied the whole line per
    # read: a 32 MiB line took 3.4 s).
    pending = bytearray()
    while True:
        if pending:
            ready, _, _ = select.select([fd], [], [], _PARTIAL_LINE_S)
            if not ready:
                on_line(bytes(pending))
                pending.clear()
                continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        if on_chunk is not None:
            on_chunk(chunk)
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if end < 0:
            pending += chunk
            continue
        pending += chunk[: end + 1]
        for line in pending.splitlines(keepends=True):
            on_line(bytes(line))
        pending = bytearray(chunk[end + 1 :])
    if pending:
        on_line(bytes(pending))
    source.close()


def redraw_as_line(line: bytes) -> bytes:
    """A line from `pump_lines` that a lone carriage return ended (a progress bar's redraw),
    as a line of its own ended by ``\n``; any other line unchanged.

    For output that reaches a file or a pipe, where the launcher labels every line it reads
    with the rank: a redraw then keeps its label and its line (in a file, ``\r`` left the
    bar's ``[0] `` labels run together, ``[0] [0]  1/30``). The backspaces a bar writes to
    step back over itself are dropped with the carriage return; the return that starts a
    bar, with nothing before it, becomes an empty line (``b"\n"``), for the caller to drop
    at a line start.
    """
    if not line.endswith(b"\r"):
        return line
    return line[:-1].rstrip(b"\b") + b"\n"


def write_all(fd: int, data: bytes) -> None:
    """Write ``data`` in full, dropping it if the terminal went away."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError:
            return
        view = view[written:]
