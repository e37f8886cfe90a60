"""Per-rank supervisor that ``ringrun`` puts between the MPI launcher and the user's program.

Run as ``python -m ringplug.run.launch.wrapper [--output-dir DIR] -- command [args...]``. It starts
the command as a child that inherits everything the launcher set up (environment, PMI file
descriptors), makes sure the child dies with it, forwards SIGTERM/SIGINT, optionally tees the
child's output into per-rank files, and, when ``ringrun`` set ``RINGPLUG_RUN_EVENTS``, tells
it through its stderr (which the launcher carries back from every host) that the program
started and, if the program fails, how it ended (see :mod:`ringplug.run.launch.status`).

When the program has ended, the wrapper ends every process it left behind, on every path
out of the job (see :mod:`ringplug.run.launch.tree`). The launchers end a rank by signalling
the wrapper's process group, SIGKILL included, which no process can outlast to clean up. So
the wrapper is two processes: the one the launcher started (the front) only passes its
signals on and exits with the status of the one behind it, which runs in a process group of
its own, supervises the program, and adopts its orphans. When the front is killed, the one
behind hears it through a parent-death signal, kills the program, ends what is left, and
exits within seconds.

Standard library only: importing mpi4py or ``ringplug.core`` here would initialise MPI in the
wrapper, which is not a rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from ringplug import config, wire
from ringplug.forensics.stacks import HEARTBEAT_SECONDS, STACKS_DIR_VARIABLE, outside
from ringplug.run.launch.processes import (
    become_subreaper,
    die_with_parent,
    framework_rank_variables,
    parent_death_signal,
    pump_lines,
    rank_from_environment,
    redraw_as_line,
    size_from_environment,
    write_all,
)
from ringplug.run.launch.stacks import REQUESTED
from ringplug.run.launch.status import (
    RankOutput,
    RankStacks,
    RankStarted,
    RankStatus,
    event_line,
    signal_name,
)
from ringplug.run.launch.terminal import TerminalSpec, open_pseudo_terminal, read_chunk
from ringplug.run.launch.threads import thread_variables
from ringplug.run.launch.tree import KILL_WAIT_S, TERMINATE_GRACE_S, Survivor, end_descendants

# How long output pipes may stay open after the child exited (a grandchild may hold them).
_DRAIN_TIMEOUT_S = 5.0

# The signals the launcher sends the wrapper that the wrapper passes on or answers.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

STOP_BACKSTOP_S = 30.0
"""How long the program may run on after the wrapper passed it SIGTERM or SIGINT, before the
wrapper kills it. ringrun itself kills a job 25 s after its SIGTERM (`Teardown.signal_grace_s`,
time to save a checkpoint), so this acts only when nobody else will: ringrun was SIGKILLed
and its launcher waits forever for a program that ignores SIGTERM."""


def rank_directory_name(rank: int, size: int | None) -> str:
    """``rank.07`` style names, padded to the widest rank so that they sort numerically."""
    width = len(str(size - 1)) if size and size > 1 else 1
    return f"rank.{rank:0{width}d}"


class _Terminal:
    """One of the wrapper's own output descriptors, written a whole piece at a time.

    Remembers whether the last byte written ended a line, so that an event line written
    while the program's output is mid-line starts on a line of its own.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.at_line_start = True

    def write(self, data: bytes) -> None:
        with self.lock:
            write_all(self.fd, data)
            if data:
                self.at_line_start = data.endswith((b"\n", b"\r"))

    def write_line(self, line: bytes) -> None:
        """Write a complete line, starting a new line first if the output is mid-line."""
        with self.lock:
            write_all(self.fd, line if self.at_line_start else b"\n" + line)
            self.at_line_start = True


def _pump(
    source: BinaryIO, terminal: _Terminal, copy: BinaryIO | None, redraws_as_lines: bool = False
) -> None:
    """Copy the child's output to the terminal in whole lines, and raw into ``copy``.

    hydra's ``-prepend-rank`` and Open MPI's ``--tag-output`` tag every chunk they read, so
    a line written in pieces (unbuffered Python prints word by word) would come out broken
    and tagged mid-line. With `redraws_as_lines` (ringrun's stream is a file or a pipe),
    each redraw of a progress bar becomes a line of its own (`redraw_as_line`).
    """

    def show(line: bytes) -> None:
        if redraws_as_lines:
            line = redraw_as_line(line)
            if line == b"\n" and terminal.at_line_start:
                return  # a bar's return to a line start: nothing to show, and no label
        terminal.write(line)

    def keep(chunk: bytes) -> None:
        nonlocal copy
        if copy is None:
            return
        try:
            copy.write(chunk)
            copy.flush()
        except (OSError, ValueError):
            copy = None  # a full disk must not stop the terminal copy

    pump_lines(source, show, keep)


def _pump_terminal(
    controller: int, terminal: _Terminal, copy: BinaryIO | None, token: str, rank: int
) -> None:
    """Send what the program writes to its pseudo-terminal on to ringrun as output events.

    Each read goes out at once, as one event line: a progress bar's carriage returns and
    cursor moves reach ringrun's terminal unchanged and as soon as they are drawn.
    """
    try:
        while chunk := read_chunk(controller):
            if copy is not None:
                try:
                    copy.write(chunk)
                    copy.flush()
                except (OSError, ValueError):
                    copy = None  # a full disk must not stop the terminal copy
            terminal.write_line(event_line(token, RankOutput(rank, chunk).to_event()))
    finally:
        os.close(controller)


class RankWrapper:
    """Runs one rank's command as a supervised child process.

    Args:
        command: the program and its arguments.
        output_dir: directory under which ``rank.<rank>/stdout`` and ``/stderr`` receive a
            copy of the child's output. Defaults to ``None`` (no copies).
        environ: the environment to read rank facts from. Defaults to ``os.environ``.
    """

    def __init__(
        self,
        command: Sequence[str],
        output_dir: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.command = list(command)
        self.output_dir = output_dir
        self.environ = os.environ if environ is None else environ
        self.rank = rank_from_environment(self.environ)
        self.child: subprocess.Popen[bytes] | None = None
        self._pending_signal: int | None = None
        self._front: int | None = None  # the process the launcher started, once forked
        self._killed_for_front = False  # the program was killed because the front died
        self._backstop: threading.Timer | None = None  # started by the first stop signal
        self._stdout = _Terminal(sys.stdout.fileno())
        self._stderr = _Terminal(sys.stderr.fileno())
        self._events_token = self.environ.get(wire.EVENTS_VARIABLE) or None
        # Rank 0 writes to a pseudo-terminal where ringrun's own output is a terminal; its
        # bytes then travel as events, so that needs the events token.
        spec = TerminalSpec.from_environment(self.environ) if self._events_token else None
        self._terminal = spec if spec is not None and not self.rank else None
        self._stacks = _StackWatch(self) if self._events_token else None

    def run(self) -> int:
        """Start the child, wait for it, report a failure, end what it left running; return
        the shell-style exit code."""
        # If the launcher's per-host proxy is SIGKILLed during a teardown, the front goes
        # too, and the keeper behind it ends the program and all it started.
        die_with_parent()
        front = os.getpid()
        front_died = parent_death_signal(signal.SIGTERM)
        # Blocked across the fork: a signal that arrives meanwhile waits until the process
        # it reached has its handler, instead of ending it by the default action.
        signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
        keeper = os.fork()  # before any thread of this process exists
        if keeper:
            return _front(keeper)
        self._front = front
        # Out of the group the launcher signals, so that its SIGKILL leaves the keeper
        # alive to clean up; then told when the front dies, and parent of every orphan.
        os.setpgid(0, 0)
        if front_died is not None:
            front_died()
        become_subreaper()
        try:
            return self._keep()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)

    def _keep(self) -> int:
        """The keeper's part of `run`: everything but passing the launcher's signals on."""
        files: list[BinaryIO | None] = [None, None]
        if self.output_dir is not None:
            files = self._open_output_files()
        previous = {
            sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        if self._stacks is not None:
            # The launcher passes ringrun's SIGUSR1 to every wrapper: answer with the stacks.
            previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._stacks.on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        # Per stream: the pseudo-terminal's (controller, program end), or None for a pipe.
        ttys: dict[str, tuple[int, int]] = {}
        # The program knows its rank from its first line, as under torchrun (see
        # `framework_rank_variables`).
        env = {
            **self.environ,
            **framework_rank_variables(self.environ),
            **thread_variables(self.environ),  # its share of this host's cores
        }
        if self._stacks is not None:
            env[STACKS_DIR_VARIABLE] = str(self._stacks.folder)
        if self._terminal is not None:
            ttys = {name: open_pseudo_terminal(self._terminal) for name in self._terminal.streams}
            if self._terminal.term and "TERM" not in self.environ:
                env["TERM"] = self._terminal.term
        try:
            try:
                self.child = subprocess.Popen(
                    self.command,
                    stdout=ttys["stdout"][1] if "stdout" in ttys else subprocess.PIPE,
                    stderr=ttys["stderr"][1] if "stderr" in ttys else subprocess.PIPE,
                    env=env,
                    # MPICH hands its PMI connection over as an inherited descriptor (PMI_FD);
                    # Open MPI/PMIx may do the same. Keep every inherited descriptor open.
                    close_fds=False,
                    # Its own process group: the launcher signals the wrapper's group, and a
                    # SIGUSR1 meant for the wrapper would end a program without a handler (or
                    # trip Lightning's SLURM requeue). SIGTERM/SIGINT are forwarded instead.
                    preexec_fn=_own_group_dying_with(parent_death_signal(signal.SIGKILL)),
                )
            except OSError as error:
                for controller, _ in ttys.values():
                    os.close(controller)
                print(
                    f"ringrun wrapper: cannot start {self.command[0]!r}: {error.strerror}",
                    file=sys.stderr,
                    flush=True,
                )
                self._report(pid=os.getpid(), returncode=127)
                return 127
            finally:
                for _, program_end in ttys.values():
                    os.close(program_end)  # the child holds its own copy
            self._mark_started(self.child.pid)
            if self._stacks is not None:
                self._stacks.start(self.child.pid)
            if self._pending_signal is not None:
                # A stop request that arrived while the child was being started.
                self._signal_child(self._pending_signal)
            threads = [
                self._pump_thread(name, source, terminal, copy, ttys)
                for name, source, terminal, copy in (
                    ("stdout", self.child.stdout, self._stdout, files[0]),
                    ("stderr", self.child.stderr, self._stderr, files[1]),
                )
            ]
            for thread in threads:
                thread.start()
            returncode = self._wait_for_child()
            # At once, before draining the output: when a rank ends without MPI_Finalize the
            # launcher kills every wrapper within moments, and ringrun must hear of it.
            # ringrun takes the report out of the output, wherever it falls.
            if self._stacks is not None:
                self._relay_fault(self._stacks.folder / wire.FAULT_FILE)
            if not self._killed_for_front:
                # (Killed because the launcher killed the front: it meant to end the rank
                # unheard, as it did before the wrapper had a keeper, and a SIGKILL
                # reported here would be taken for the job's cause.)
                self._report(pid=self.child.pid, returncode=returncode)
            # Before draining: a helper the program started may hold its output open.
            self._end_what_is_left()
            for thread in threads:
                thread.join(_DRAIN_TIMEOUT_S)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._backstop is not None:
                self._backstop.cancel()
            if self._stacks is not None:
                self._stacks.stop()
            for file in files:
                if file is not None:
                    file.close()
        return 128 - returncode if returncode < 0 else returncode

    def _pump_thread(
        self,
        name: str,
        source: BinaryIO | None,
        terminal: _Terminal,
        copy: BinaryIO | None,
        ttys: Mapping[str, tuple[int, int]],
    ) -> threading.Thread:
        """The thread that passes one of the child's streams on: a pipe's lines or a tty's bytes."""
        if name in ttys:
            assert self._events_token is not None
            args: tuple[object, ...] = (ttys[name][0], terminal, copy, self._events_token, 0)
            return threading.Thread(target=_pump_terminal, args=args, daemon=True)
        assert source is not None
        # Bars redrawn in place suit a terminal, but in ringrun's file or pipe a redraw's
        # labels ran together: there each redraw becomes a line.
        spec = TerminalSpec.from_environment(self.environ)
        to_file = spec is None or name not in spec.streams
        args = (source, terminal, copy, to_file)
        return threading.Thread(target=_pump, args=args, daemon=True)

    def _wait_for_child(self) -> int:
        """Wait for the program, reaping meanwhile the orphans this process adopted; return
        its status as ``Popen.returncode`` gives it."""
        assert self.child is not None
        while True:
            # Any child's end, not only the program's: an adopted orphan that ended must
            # leave the process table, and only this thread reaps (the signal handlers
            # must not, or this wait would miss the program's end).
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:  # someone else reaped it: no status to tell
                return self.child.wait()
            if pid == self.child.pid:
                self.child.returncode = os.waitstatus_to_exitcode(status)
                return self.child.returncode

    def _end_what_is_left(self) -> None:
        """End every process the program left running, and name those that outlive it."""
        assert self.child is not None
        survivors = end_descendants(
            os.getpid(), group=self.child.pid, hurry=lambda: self._front_gone
        )
        if survivors:
            self._name_survivors(survivors)

    def _name_survivors(self, survivors: list[Survivor]) -> None:
        rank = 0 if self.rank is None else self.rank
        host = socket.gethostname()
        waited = TERMINATE_GRACE_S + KILL_WAIT_S
        for survivor in survivors:
            self._stderr.write_line(
                f"ringrun: rank {rank} on host {host}: {survivor.describe()} is still running "
                f"{waited:g} s after the rank's program ended, through SIGTERM and SIGKILL; "
                f"it may hold GPU memory, ports or files: end it on {host} "
                f"(`{survivor.kill_command}`), or restart the host if it stays\n".encode()
            )

    @property
    def _front_gone(self) -> bool:
        """Whether the front process the launcher started is gone (killed in a teardown)."""
        return self._front is not None and os.getppid() != self._front

    def _forward(self, signum: int, frame: object) -> None:
        """Pass SIGTERM/SIGINT on to the child, and kill it if it still runs
        `STOP_BACKSTOP_S` later; the wrapper ends when the child does.

        A SIGTERM that comes when the front is gone is its death signal: the launcher has
        killed this rank, so the program is killed too, as the front's death would have
        killed it had the program been its child.
        """
        if self._front_gone:
            signum = signal.SIGKILL
            self._killed_for_front = self.child is None or self.child.returncode is None
        elif self._backstop is None:
            self._backstop = threading.Timer(STOP_BACKSTOP_S, self._signal_child, (signal.SIGKILL,))
            self._backstop.daemon = True
            self._backstop.start()
        if self.child is None:
            self._pending_signal = signum
        else:
            self._signal_child(signum)

    def _signal_child(self, signum: int) -> None:
        """Signal the program unless it was reaped (`Popen.send_signal` would reap it here,
        in a signal handler, and `_wait_for_child` would wait for it forever)."""
        if self.child is None:  # the backstop of a stop that came before the start
            self._pending_signal = signum
        elif self.child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, signum)

    def _open_output_files(self) -> list[BinaryIO | None]:
        """Create ``rank.<rank>/stdout`` and ``stderr`` under the output directory."""
        assert self.output_dir is not None
        rank = 0 if self.rank is None else self.rank
        directory = Path(self.output_dir) / rank_directory_name(
            rank, size_from_environment(self.environ)
        )
        directory.mkdir(parents=True, exist_ok=True)
        return [(directory / "stdout").open("wb"), (directory / "stderr").open("wb")]

    def _mark_started(self, pid: int) -> None:
        """Tell ``ringrun`` this rank's program runs, if it asked."""
        rank = 0 if self.rank is None else self.rank
        self._send_event(RankStarted(rank=rank, host=socket.gethostname(), pid=pid).to_event())

    def _report(self, pid: int, returncode: int) -> None:
        """Tell ``ringrun`` how the program ended, if it asked."""
        status = RankStatus(
            # Without any launcher variables this is a lone process, i.e. rank 0.
            rank=0 if self.rank is None else self.rank,
            host=socket.gethostname(),
            pid=pid,
            exit_code=returncode if returncode >= 0 else None,
            signal_name=signal_name(-returncode) if returncode < 0 else None,
            timestamp=time.time(),
        )
        self._send_event(status.to_event())

    def _relay_fault(self, path: Path) -> None:
        """Send the fault the rank left in `path`, if any: its stderr, which carried it
        too, may have been captured by the program (ringrun drops the second copy)."""
        try:
            fault = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(fault, dict) and fault.get("event") == wire.FAULT:
            self._send_event(fault)

    def _send_event(self, event: dict[str, object]) -> None:
        if self._events_token is not None:
            self._stderr.write_line(event_line(self._events_token, event))


def _front(keeper: int) -> int:
    """The wrapper as the launcher sees it: pass the launcher's signals on to the keeper,
    and end with its status."""

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(keeper, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    _, status = os.waitpid(keeper, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _own_group_dying_with(then: Callable[[], None] | None) -> Callable[[], None]:
    """A ``preexec_fn``: put the child in a process group of its own, then run `then`."""

    def prepare() -> None:
        os.setpgid(0, 0)
        if then is not None:
            then()

    return prepare


class _StackWatch:
    """The wrapper's eye on its rank: the rank's stacks on request, and when it stops
    running Python.

    The rank's heartbeat (`ringplug.forensics.stacks`) needs the interpreter lock: when it
    is older than ``RINGPLUG_STALL_CHECK_SECONDS``, no Python thread of the rank ran for
    that long (C code holds the lock, or the process is stopped), ringplug's own stall
    inspector cannot speak for it, and the wrapper reports its stacks, once per episode.
    """

    def __init__(self, wrapper: RankWrapper) -> None:
        self.wrapper = wrapper
        self.folder = Path(tempfile.mkdtemp(prefix="ringrun-stacks-"))
        self.check_s = _stall_check_seconds(wrapper.environ)
        self._asked = threading.Event()
        self._stopped = threading.Event()
        self.pid = 0

    def start(self, pid: int) -> None:
        self.pid = pid
        threading.Thread(target=self._watch, name="ringrun-stacks", daemon=True).start()

    def on_signal(self, signum: int, frame: object) -> None:
        self._asked.set()

    def stop(self) -> None:
        self._stopped.set()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _watch(self) -> None:
        reported = False  # in this episode of a stale heartbeat
        beat = self.folder / f"{self.pid}.beat"
        while not self._stopped.is_set():
            if self._asked.wait(min(1.0, max(self.check_s / 4, 0.1))):
                self._asked.clear()
                self._send(REQUESTED)
            with contextlib.suppress(OSError):
                age = time.time() - beat.stat().st_mtime
                # The beat comes every second, later on a busy host: a margin of two.
                if age < self.check_s + 2 * HEARTBEAT_SECONDS:
                    reported = False
                elif not reported:
                    reported = True
                    self._send(
                        f"no Python thread of it ran for {age:.0f} s (RINGPLUG_STALL_CHECK_SECONDS="
                        f"{self.check_s:g}): it is stopped, or C code holds the interpreter lock",
                        interrupt=False,
                    )

    def _send(self, reason: str, interrupt: bool = True) -> None:
        if self._stopped.is_set():
            return
        report = outside(self.pid, self.folder, interrupt=interrupt)
        rank = 0 if self.wrapper.rank is None else self.wrapper.rank
        event = RankStacks(rank, socket.gethostname(), reason, report)
        self.wrapper._send_event(event.to_event())


def _stall_check_seconds(environ: Mapping[str, str]) -> float:
    """The ranks' RINGPLUG_STALL_CHECK_SECONDS (they refuse a bad value; here it is the
    default)."""
    try:
        return float(config.STALL_CHECK_SECONDS.read(environ))
    except ValueError:
        return float(config.STALL_CHECK_SECONDS.default)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ringplug.run.launch.wrapper``."""
    parser = argparse.ArgumentParser(
        prog="python -m ringplug.run.launch.wrapper",
        description="Supervise one rank's command for ringrun.",
    )
    parser.add_argument("--output-dir", help="copy stdout/stderr into DIR/rank.<rank>/")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command [args...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given; use: -- command [args...]")
    return RankWrapper(command, output_dir=args.output_dir).run()


if __name__ == "__main__":
    sys.exit(main())
