"""A process's Python stacks, from inside or from outside, and how to print them by rank.

Every rank `install`s a stack handler when ringplug starts: `faulthandler` answers
`DUMP_SIGNAL` by writing every thread's stack to the process's own file in the stacks
folder. It writes from the signal handler, in C, so it answers while the interpreter lock
is held by C code (a regular expression, a C extension) that no Python thread can
interrupt. DataLoader workers forked later get their own file (`os.register_at_fork`).
Under ringrun the wrapper names the folder (`STACKS_DIR_VARIABLE`), and a heartbeat thread
touches ``<pid>.beat`` every second: a beat older than the stall check means no Python
thread of the rank ran for that long, and the wrapper takes the stacks from outside.

Taking stacks from outside (`outside`) reads the process's state from ``/proc`` first: a
stopped process (SIGSTOP, a debugger) answers no signal until it runs again, so its report
says it is stopped instead. The signal goes only to a process whose handler is installed
(``SigCgt`` in ``/proc/PID/status``): its default action would end it.

Reports are plain data (`ProcessStacks`, JSON through `to_dict`/`from_dict`), so that they
travel as ringrun events from any host; `report_lines` and `grouped_lines` print them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import os
import re
import shutil
import signal
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ringplug import wire

STACKS_DIR_VARIABLE = wire.STACKS_DIR_VARIABLE  # where the wrapper wants stacks and heartbeat

# A real-time signal: no library ringplug sits on uses it (Lightning's SLURM requeue takes
# SIGUSR1, MPICH and Open MPI forward SIGUSR1/SIGUSR2 to the ranks).
DUMP_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None

HEARTBEAT_SECONDS = 1.0
_SHOWN_FRAMES = 24  # innermost frames shown per thread
_USER_MARK = "   <-- innermost user frame"

_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible sleep (disk or swap)",
    "T": "stopped (SIGSTOP or job control)",
    "t": "stopped by a debugger",
    "Z": "a zombie (exited, not yet reaped)",
    "X": "dead",
    "I": "idle",
}


@dataclasses.dataclass
class Frame:
    """One frame of a stack: where it is."""

    file: str
    line: int
    function: str


@dataclasses.dataclass
class ThreadStack:
    """One thread's stack, outermost frame first (as tracebacks print)."""

    name: str
    frames: list[Frame]
    main: bool = False


@dataclasses.dataclass
class ProcessStacks:
    """What a process was doing: its OS state, each thread's stack, and its children's.

    Args:
        pid: the process.
        state: its state from the OS in words (``"sleeping"``, ``"stopped (SIGSTOP ...)"``).
        threads: its threads' stacks, the main thread first; empty when none could be taken.
        note: why there are no stacks, or how they were taken; empty when nothing to say.
        children: the same for its child processes (a DataLoader's workers).
    """

    pid: int
    state: str
    threads: list[ThreadStack] = dataclasses.field(default_factory=list)
    note: str = ""
    children: list[ProcessStacks] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProcessStacks:
        """The report `to_dict` made.

        Raises:
            ValueError: not such a report.
        """
        try:
            return cls(
                pid=int(data["pid"]),
                state=str(data["state"]),
                threads=[
                    ThreadStack(
                        str(t["name"]),
                        [
                            Frame(str(f["file"]), int(f["line"]), str(f["function"]))
                            for f in t["frames"]
                        ],
                        bool(t.get("main", False)),
                    )
                    for t in data.get("threads", [])
                ],
                note=str(data.get("note", "")),
                children=[cls.from_dict(c) for c in data.get("children", [])],
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a stack report: {data!r}") from error


# ---------------------------------------------------------------------------- the rank side
_installed: dict[str, Any] = {}


def install(directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Make this process answer `DUMP_SIGNAL` with its stacks (idempotent); return the folder.

    The folder is `directory`, else the wrapper's (`STACKS_DIR_VARIABLE`), else a new
    temporary one. Under the wrapper a heartbeat thread starts too. Returns None where
    the platform has no real-time signals.
    """
    if DUMP_SIGNAL is None:
        return None
    if _installed.get("pid") == os.getpid():
        return _installed["directory"]
    given = directory or os.environ.get(STACKS_DIR_VARIABLE)
    folder = Path(given) if given else Path(tempfile.mkdtemp(prefix="ringplug-stacks-"))
    folder.mkdir(parents=True, exist_ok=True)
    if not given:
        atexit.register(_remove_own, folder, os.getpid())
    _register(folder)
    if not _installed.get("at_fork"):
        os.register_at_fork(after_in_child=_after_fork)
        _installed["at_fork"] = True
    if given:  # someone else reads the folder: keep the heartbeat and the names current
        threading.Thread(
            target=_heartbeat, args=(folder,), name="ringplug-heartbeat", daemon=True
        ).start()
    return folder


def _remove_own(folder: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that exits
        shutil.rmtree(folder, ignore_errors=True)


def _register(folder: Path) -> None:
    pid = os.getpid()
    stream = (folder / f"{pid}.stacks").open("w")
    faulthandler.register(DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
    previous = _installed.get("stream")
    _installed.update(pid=pid, directory=folder, stream=stream)
    if previous is not None:
        with contextlib.suppress(OSError):
            previous.close()  # a forked child's copy of its parent's file
    _write_names(folder, pid)


def _after_fork() -> None:
    """In a forked child (a DataLoader worker): its own stack file, not its parent's."""
    folder = _installed.get("directory")
    if folder is not None:
        with contextlib.suppress(OSError):
            _register(folder)


def _write_names(folder: Path, pid: int) -> tuple[int, ...]:
    """Write ``<pid>.threads`` (thread ident -> name) for readers of outside dumps."""
    threads = threading.enumerate()
    main = threading.main_thread().ident
    lines = [
        f"{t.ident:#x} {'main' if t.ident == main else '-'} {t.name}" for t in threads if t.ident
    ]
    temporary = folder / f".{pid}.threads"
    with contextlib.suppress(OSError):
        temporary.write_text("\n".join(lines) + "\n")
        temporary.replace(folder / f"{pid}.threads")
    return tuple(sorted(t.ident or 0 for t in threads))


def _heartbeat(folder: Path) -> None:
    """Touch ``<pid>.beat`` every second (and keep the thread names current): it needs the
    interpreter lock, so a stale beat means no Python thread of this process could run."""
    pid = os.getpid()
    beat = folder / f"{pid}.beat"
    known: tuple[int, ...] = ()
    while os.getpid() == pid:
        try:
            beat.touch()
            idents = tuple(sorted(t.ident or 0 for t in threading.enumerate()))
            if idents != known:
                known = _write_names(folder, pid)
        except OSError:
            return  # the folder is gone: the wrapper ended
        time.sleep(HEARTBEAT_SECONDS)


def own_stacks(children_folder: Path | None = None, include_caller: bool = False) -> ProcessStacks:
    """This process's stacks from inside (thread names exact), with its children's from
    outside; the calling thread's only with `include_caller` (the engine's is no news)."""
    frames = sys._current_frames()
    main = threading.main_thread().ident
    by_ident = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    threads = []
    for ident, frame in frames.items():
        if ident == me and not include_caller:
            continue  # the thread taking the report
        stack = []
        while frame is not None:
            stack.append(Frame(frame.f_code.co_filename, frame.f_lineno or 0, frame.f_code.co_name))
            frame = frame.f_back
        stack.reverse()
        threads.append(ThreadStack(by_ident.get(ident, f"thread {ident:#x}"), stack, ident == main))
    threads.sort(key=lambda t: not t.main)
    pid = os.getpid()
    folder = children_folder or _installed.get("directory")
    kids = [outside(child, folder) for child in child_pids(pid)] if folder else []
    return ProcessStacks(pid, process_state(pid), threads, "", kids)


# ---------------------------------------------------------------------------- from outside
def process_state(pid: int) -> str:
    """The process's state from ``/proc`` in words, with its swapped-out memory if any
    (``"unknown"`` without ``/proc``; ``"gone"`` when it no longer exists)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "unknown"
    letter = stat[stat.rfind(")") + 2 :].split(" ", 1)[0]
    words = _STATES.get(letter, letter)
    with contextlib.suppress(OSError):
        match = re.search(r"^VmSwap:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
        if match and int(match.group(1)) >= 1024:
            words += f", {int(match.group(1)) / 1024:.0f} MiB of it swapped out"
    return words


def _wait_channel(pid: int) -> str:
    """The kernel function the process's main thread sleeps in (``futex_wait_queue``), or ""."""
    try:
        name = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return ""
    return "" if name in ("", "0") else name


def child_pids(pid: int) -> list[int]:
    """The process's children (every thread's), from ``/proc``."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(p) for p in (task / "children").read_text().split()]
    return sorted(set(found))


def _handles_signal(pid: int) -> bool:
    """Whether the process has a handler for `DUMP_SIGNAL` (``SigCgt``)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    match = re.search(r"^SigCgt:\s+([0-9a-fA-F]+)", text, re.M)
    return bool(
        match and DUMP_SIGNAL is not None and int(match.group(1), 16) >> (DUMP_SIGNAL - 1) & 1
    )


def outside(
    pid: int,
    folder: Path | str | None,
    timeout: float = 2.0,
    children: bool = True,
    interrupt: bool = True,
) -> ProcessStacks:
    """The stacks of process `pid` taken from outside it, through its stack handler.

    A stopped process is reported as stopped (it would answer only once continued); one
    without the handler (ringplug not started yet there) by its state alone. Without
    `interrupt` a process whose main thread sleeps in a system call is not signalled either:
    a signal ends a C call's sleep early (``EINTR``; Python's own calls retry, C code may
    not), so its report gives the kernel function it waits in instead.
    """
    state = process_state(pid)
    kids = (
        [outside(c, folder, timeout, children, interrupt) for c in child_pids(pid)]
        if children
        else []
    )
    if state.startswith("stopped") or state in ("gone", "dead") or state.startswith("a zombie"):
        return ProcessStacks(
            pid, state, note="it does not run Python now: no stacks to take", children=kids
        )
    if not interrupt and not state.startswith("running"):
        where = _wait_channel(pid)
        return ProcessStacks(
            pid,
            state,
            note=f"it waits in a system call{f' ({where})' if where else ''} while holding the "
            "interpreter lock; its stacks are not taken so as not to interrupt that call "
            "(`ringrun --stacks` takes them anyway)",
            children=kids,
        )
    path = Path(folder, f"{pid}.stacks") if folder else None
    if path is None or not path.exists() or not _handles_signal(pid):
        return ProcessStacks(
            pid, state, note="no stack handler there (ringplug is not started in it)", children=kids
        )
    try:
        os.truncate(path, 0)
        os.kill(pid, DUMP_SIGNAL)
    except OSError as error:
        return ProcessStacks(
            pid, state, note=f"could not ask it for its stacks: {error}", children=kids
        )
    text = _read_settled(path, time.monotonic() + timeout)
    if not text:
        return ProcessStacks(
            pid, state, note=f"it did not write its stacks within {timeout:g} s", children=kids
        )
    names = _thread_names(Path(folder, f"{pid}.threads"))
    return ProcessStacks(pid, state, parse_faulthandler(text, names), children=kids)


def _read_settled(path: Path, deadline: float) -> str:
    """The file's text once faulthandler is done writing it, or what is there at `deadline`.

    Nothing marks the end of a dump (it is written from a signal handler, a line at a time).
    The main thread comes last and ends in a module's frame: a dump that ends so and stopped
    growing for 0.1 s is whole; any other stops growing for 0.5 s first (a process
    preempted mid-dump on a busy host).
    """
    last, since = -1, time.monotonic()
    while True:
        size = path.stat().st_size if path.exists() else 0
        now = time.monotonic()
        if size != last:
            last, since = size, now
        elif size:
            text = path.read_text(errors="replace")
            whole = text.rstrip().endswith("in <module>")
            if now - since >= (0.1 if whole else 0.5):
                return text
        if now >= deadline:
            return path.read_text(errors="replace") if path.exists() else ""
        time.sleep(0.02)


def _thread_names(path: Path) -> dict[int, tuple[str, bool]]:
    names: dict[int, tuple[str, bool]] = {}
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            ident, role, name = line.split(" ", 2)
            names[int(ident, 16)] = (name, role == "main")
    return names


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


def parse_faulthandler(
    text: str, names: Mapping[int, tuple[str, bool]] | None = None
) -> list[ThreadStack]:
    """The threads in a `faulthandler` dump (innermost frame first there), outermost first,
    named from `names` (ident -> (name, is main)) where known; the main thread first."""
    threads: list[ThreadStack] = []
    for line in text.splitlines():
        header = _THREAD.match(line)
        if header:
            ident = int(header.group(1), 16)
            name, main = (names or {}).get(ident, (f"thread {header.group(1)}", False))
            threads.append(ThreadStack(name, [], main))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            number = int(frame.group(2)) if frame.group(2).isdigit() else 0
            threads[-1].frames.insert(0, Frame(frame.group(1), number, frame.group(3)))
    if threads and not any(t.main for t in threads):
        # Without names: the main thread is the one whose outermost frame is a module's.
        for thread in threads:
            if thread.frames and thread.frames[0].function == "<module>":
                thread.main = True
                break
    threads.sort(key=lambda t: not t.main)
    return threads


# ---------------------------------------------------------------------------- printing
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(str(Path(__file__).resolve().parents[1]))  # ringplug itself
    return tuple(sorted(roots))


_ROOTS = _library_roots()


def is_user_frame(frame: Frame) -> bool:
    """Whether the frame is in the user's code: not in the standard library, an installed
    package or ringplug, nor frozen/generated code."""
    file = frame.file
    if file.startswith("<") or "/site-packages/" in file or "/dist-packages/" in file:
        return False
    return not file.startswith(_ROOTS)


def thread_lines(thread: ThreadStack, where: bool = True) -> list[str]:
    """A thread as a traceback prints it, the innermost user frame marked; ringplug's own
    threads in one line, saying where they are if `where`."""
    frames = thread.frames
    if thread.name.startswith("ringplug-") and frames:
        frame = frames[-1]
        at = f", in {frame.function} ({Path(frame.file).name})" if where else ""
        return [f"  thread {thread.name}: ringplug's{at}"]
    user = max((i for i, f in enumerate(frames) if is_user_frame(f)), default=-1)
    shown = range(max(0, len(frames) - _SHOWN_FRAMES), len(frames))
    lines = [f"  thread {thread.name}{' (main)' if thread.main else ''}:"]
    if shown.start:
        lines.append(f"    ... {shown.start} outer frame{'s' if shown.start > 1 else ''}")
    for i in shown:
        frame = frames[i]
        lines.append(
            f'    File "{frame.file}", line {frame.line}, in {frame.function}'
            + (_USER_MARK if i == user else "")
        )
    if user >= 0 and user < shown.start:
        frame = frames[user]
        lines.append(
            f'    (innermost user frame: "{frame.file}", line {frame.line}, in {frame.function})'
        )
    if not frames:
        lines.append("    (no Python frames)")
    return lines


def body_lines(report: ProcessStacks, where: bool = True) -> list[str]:
    """A report without its process ids; without `where` (of ringplug's own threads, which
    move between waits from moment to moment), equal for ranks stuck alike."""
    lines = []
    if report.note:
        lines.append(f"  {report.note}")
    for thread in report.threads:
        lines += thread_lines(thread, where)
    for child in report.children:
        lines.append(f"  child process ({child.state}):")
        lines += ["  " + line for line in body_lines(child, where)]
    return lines


def process_line(report: ProcessStacks) -> str:
    """``"pid 12, sleeping; child process 13"``: the process, its state and its children."""
    pids = ", ".join(str(c.pid) for c in report.children)
    kids = f"; child process{'es' if len(report.children) > 1 else ''} {pids}" if pids else ""
    return f"pid {report.pid}, {report.state}{kids}"


def report_lines(who: str, report: ProcessStacks) -> list[str]:
    """One process's report: a header naming `who` (``"rank 1 on host a"``), then its stacks."""
    return [f"{who} ({process_line(report)}):", *body_lines(report)]


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = previous = None
    for rank in [*ordered, None]:
        if start is not None and (rank is None or rank != previous + 1):
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = None
        if rank is not None and start is None:
            start = rank
        previous = rank
    return ", ".join(parts)


def grouped_lines(
    reports: Mapping[int, ProcessStacks], hosts: Mapping[int, str] | None = None
) -> list[str]:
    """Every rank's report, ranks with the same stacks printed once together."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank in sorted(reports):
        groups.setdefault(tuple(body_lines(reports[rank], where=False)), []).append(rank)
    lines: list[str] = []
    for body, ranks in sorted(groups.items(), key=lambda item: item[1][0]):
        if len(ranks) == 1:
            host = (hosts or {}).get(ranks[0])
            who = f"rank {ranks[0]}" + (f" on host {host}" if host else "")
            lines += report_lines(who, reports[ranks[0]])
        else:
            states = sorted({reports[r].state for r in ranks})
            lines.append(f"ranks {rank_ranges(ranks)} ({', '.join(states)}):")
            lines += _merged(body, {r: body_lines(reports[r]) for r in ranks})
    return lines


def _merged(body: Sequence[str], detailed: Mapping[int, list[str]]) -> list[str]:
    """The lines of a group of ranks: `body`'s, where each rank's own line (`detailed`,
    line for line) says where ringplug's thread is, and where ranks differ, which is where:
    ``thread ringplug-engine: ringplug's, in _sleep (engine.py) on rank 0; in wait
    (threading.py) on ranks 2-3``."""
    out = []
    for index, line in enumerate(body):
        seen: dict[str, list[int]] = {}  # each rank's own line -> the ranks that have it
        for rank, lines in detailed.items():
            seen.setdefault(lines[index], []).append(rank)
        if len(seen) == 1:
            out.append(next(iter(seen)))
            continue
        # Only ringplug's thread lines differ: `line` + ", in FUNCTION (FILE)".
        out.append(
            f"{line}, "
            + "; ".join(
                f"{own[len(line) + 2 :]} on rank{'s' if len(ranks) > 1 else ''} "
                f"{rank_ranges(ranks)}"
                for own, ranks in seen.items()
            )
        )
    return out


def innermost_user_frame(report: ProcessStacks) -> Frame | None:
    """The innermost user frame of the main thread (else any thread), for one-line summaries."""
    for thread in sorted(report.threads, key=lambda t: not t.main):
        for frame in reversed(thread.frames):
            if is_user_frame(frame):
                return frame
    return None


def summary(report: ProcessStacks) -> str:
    """Where the process is, in a few words: ``"in wait_forever (train.py:12)"``."""
    frame = innermost_user_frame(report)
    if frame is None:
        return report.note or report.state
    return f"in {frame.function} ({Path(frame.file).name}:{frame.line})"
