"""Rank 0 in a terminal: its program gets a pseudo-terminal, its bytes reach ringrun's as written.

When ``ringrun``'s stdout (or stderr) is a terminal, it tells the ranks so in
:data:`TERMINAL_VARIABLE`, with the terminal's size. Rank 0's wrapper then gives its program
a pseudo-terminal of that size on that stream, as ``srun --pty`` does for task zero: the
program sees a terminal (Python flushes by line, rich draws its live display, tqdm sizes its
bar) and what it writes travels to ringrun as :class:`~ringplug.run.launch.status.RankOutput`
events, whole lines the launcher cannot split or tag. ringrun writes those bytes to its
terminal as they are, without a rank prefix, as in a plain run. The other ranks' lines keep
their launcher prefix (``[1] ...``); one that arrives while rank 0 has an unfinished line (a
progress bar) clears that line, prints, and draws it again below.

When ringrun's output goes to a pipe or a file, nothing changes: every rank writes to pipes
and every line carries its prefix.

Standard library only: the wrapper imports this inside every rank.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import termios
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from ringplug import wire
from ringplug.run.launch.processes import write_all

TERMINAL_VARIABLE = wire.TERMINAL_VARIABLE  # which streams are a terminal, and its size

STREAMS = ("stdout", "stderr")

# One read from the pseudo-terminal becomes one event line; the launcher passes a line whole
# when it fits a pipe's atomic write (PIPE_BUF, 4096 on Linux): 2048 bytes are 2732 in base64.
CHUNK_BYTES = 2048

# The part of rank 0's unfinished line that is drawn again after another rank's line; past
# this, only what follows its last carriage return is kept.
_REDRAW_LIMIT = 16384
_CLEAR_LINE = b"\r\x1b[K"


@dataclass(frozen=True)
class TerminalSpec:
    """Which of rank 0's streams get a pseudo-terminal, and how large it is.

    Args:
        streams: the streams, among ``"stdout"`` and ``"stderr"``, that are a terminal.
        columns: the terminal's width in characters.
        lines: its height in lines.
        term: the terminal type (``TERM``) to give the program when it has none, or ``""``.
    """

    streams: tuple[str, ...]
    columns: int
    lines: int
    term: str = ""

    def to_variable(self) -> str:
        """The value of :data:`TERMINAL_VARIABLE`: ``stdout,stderr 120x40 xterm-256color``."""
        return f"{','.join(self.streams)} {self.columns}x{self.lines} {self.term}".rstrip()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> TerminalSpec | None:
        """The spec ringrun set, or ``None`` when it set none (or one this cannot read)."""
        fields = environ.get(TERMINAL_VARIABLE, "").split()
        if len(fields) not in (2, 3):
            return None
        streams = tuple(name for name in fields[0].split(",") if name in STREAMS)
        columns, _, lines = fields[1].partition("x")
        if not streams or not columns.isdigit() or not lines.isdigit():
            return None
        return cls(streams, int(columns), int(lines), fields[2] if len(fields) == 3 else "")


def describe_terminal(fds: Mapping[str, int], environ: Mapping[str, str]) -> TerminalSpec | None:
    """The spec for ringrun's own streams (``{"stdout": 1, "stderr": 2}``), or ``None``.

    ``None`` when neither is a terminal, or when ``TERM`` says it cannot move the cursor
    (``dumb``): then rank 0 writes to pipes as the others do.
    """
    streams = tuple(name for name in STREAMS if name in fds and _is_terminal(fds[name]))
    term = environ.get("TERM", "")
    if not streams or term in ("dumb", "unknown"):
        return None
    try:
        size = os.get_terminal_size(fds[streams[0]])
    except OSError:
        return None
    return TerminalSpec(streams, size.columns, size.lines, term)


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def open_pseudo_terminal(spec: TerminalSpec) -> tuple[int, int]:
    """A pseudo-terminal of the spec's size, as ``(controller, program_end)`` descriptors.

    Output processing is off, so the bytes read from the controller are exactly those the
    program wrote (no ``\\n`` turned into ``\\r\\n``); ringrun's own terminal does that.
    """
    controller, program_end = os.openpty()
    attributes = termios.tcgetattr(program_end)
    attributes[1] &= ~termios.OPOST  # output modes
    attributes[3] &= ~(termios.ECHO | termios.ICANON)  # local modes: nothing is typed here
    termios.tcsetattr(program_end, termios.TCSANOW, attributes)
    size = struct.pack("HHHH", spec.lines, spec.columns, 0, 0)
    with contextlib.suppress(OSError):
        fcntl.ioctl(program_end, termios.TIOCSWINSZ, size)
    return controller, program_end


def read_chunk(controller: int) -> bytes:
    """The next bytes the program wrote, or ``b""`` once every program end is closed.

    Linux reports the closed far end of a pseudo-terminal as ``EIO``, not as end of file.
    """
    try:
        return os.read(controller, CHUNK_BYTES)
    except OSError:
        return b""


class TerminalSink:
    """ringrun's terminal, written by rank 0's raw bytes and by the other ranks' lines.

    It remembers rank 0's unfinished line (a progress bar being drawn) so that a line from
    another rank goes above it: clear the line, write the other rank's line, draw rank 0's
    again. Shared by ringrun's stdout and stderr relays when both are the same terminal.

    Args:
        fd: the terminal's descriptor.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.unfinished = bytearray()  # rank 0's bytes since its last newline
        self.mid_line = False

    def raw(self, data: bytes) -> None:
        """Write rank 0's bytes as they are."""
        with self.lock:
            write_all(self.fd, data)
            end = data.rfind(b"\n")
            if end >= 0:
                self.unfinished = bytearray(data[end + 1 :])
            else:
                self.unfinished += data
            if len(self.unfinished) > _REDRAW_LIMIT:
                start = self.unfinished.rfind(b"\r")
                self.unfinished = self.unfinished[start:] if start >= 0 else bytearray()
            if data:
                self.mid_line = not data.endswith(b"\n")

    def line(self, data: bytes) -> None:
        """Write another rank's line (prefixed by the launcher) above rank 0's unfinished one."""
        with self.lock:
            if not self.mid_line:
                write_all(self.fd, data)
                return
            ended = data if data.endswith(b"\n") else data + b"\n"
            write_all(self.fd, _CLEAR_LINE + ended + bytes(self.unfinished))

    def finish(self) -> None:
        """End rank 0's unfinished line, so that what ringrun says next starts a line."""
        with self.lock:
            if self.mid_line:
                write_all(self.fd, b"\n")
                self.mid_line = False
                self.unfinished.clear()


def terminal_sinks(fds: Mapping[str, int], spec: TerminalSpec) -> dict[str, TerminalSink]:
    """One sink per terminal among ringrun's streams: stdout and stderr share one if alike."""
    sinks: dict[str, TerminalSink] = {}
    for name in spec.streams:
        for other, sink in sinks.items():
            if _same_file(fds[name], fds[other]):
                sinks[name] = sink
                break
        else:
            sinks[name] = TerminalSink(fds[name])
    return sinks


def _same_file(first: int, second: int) -> bool:
    try:
        return os.path.samestat(os.fstat(first), os.fstat(second))
    except OSError:
        return False
