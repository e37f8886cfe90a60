"""ringrun in a terminal: rank 0's progress bars draw live, unprefixed; other ranks stay labelled.

The job runs inside a real pseudo-terminal (the way a user's terminal holds ringrun), and what
ringrun writes there is replayed on a small screen model (carriage return, newline, erase
line, cursor up) to see what the user would see.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from launch import RINGRUN
from ringplug.run.launch.status import RankOutput, parse_event
from ringplug.run.launch.terminal import TERMINAL_VARIABLE, TerminalSink, TerminalSpec
from ringplug.wire import EVENTS_VARIABLE

COLUMNS, LINES = 97, 31


def labelled(rank: int, text: str) -> re.Pattern[str]:
    """A line of ``rank`` as the launcher labels it: hydra's ``[1] ``, Open MPI's
    ``[1,1]<stdout>: ``."""
    return re.compile(rf"(\[{rank}\] |\[\d+,{rank}\]<stdout>: ?){re.escape(text)}")


# Rank 0 draws a tqdm bar on stderr and a rich bar on stdout; after step 3 of each it waits
# for the test to see that step on the terminal (a file appears), so an update the test sees
# arrived while the job ran. Rank 1 prints one line.
BARS = r"""
import os, sys, time
from pathlib import Path

rank = int(os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
here = Path(sys.argv[1])

def wait_for(name):
    deadline = time.monotonic() + 60
    while not (here / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"the test never saw step 3 ({name})")
        time.sleep(0.01)

if rank == 1:
    print(f"rank one isatty={sys.stdout.isatty()}", flush=True)
    sys.exit(0)
try:
    size = os.get_terminal_size(sys.stdout.fileno())
    size = f"{size.columns}x{size.lines}"
except OSError:
    size = "none"
print(f"rank zero isatty={sys.stdout.isatty()},{sys.stderr.isatty()} "
      f"size={size} term={os.environ.get('TERM')}")

from tqdm import tqdm
bar = tqdm(total=10, file=sys.stderr, mininterval=0, miniters=1, ascii=True,
           bar_format="tqdm {n_fmt}/{total_fmt}|{bar:10}|")
for step in range(10):
    bar.update(1)
    if step == 2:
        wait_for("go-tqdm")
bar.close()

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
columns = [TextColumn("rich {task.completed:.0f}/{task.total:.0f}"), BarColumn(bar_width=10)]
with Progress(*columns, console=Console(file=sys.stdout), auto_refresh=False) as progress:
    task = progress.add_task("steps", total=10)
    for step in range(10):
        progress.advance(task)
        progress.refresh()
        if step == 2:
            wait_for("go-rich")
print("rank zero done")
"""


class _TerminalReader(threading.Thread):
    """Collects everything written to a pseudo-terminal, and waits for a pattern in it."""

    def __init__(self, controller: int) -> None:
        super().__init__(daemon=True)
        self.controller = controller
        self.data = bytearray()
        self.changed = threading.Condition()
        self.ended = False

    def run(self) -> None:
        while True:
            try:
                chunk = os.read(self.controller, 65536)
            except OSError:
                chunk = b""
            with self.changed:
                if not chunk:
                    self.ended = True
                    self.changed.notify_all()
                    return
                self.data += chunk
                self.changed.notify_all()

    def wait_for(self, pattern: bytes, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while pattern not in self.data:
                left = deadline - time.monotonic()
                assert not self.ended and left > 0, (
                    f"{pattern!r} never reached the terminal; it showed {bytes(self.data)!r}"
                )
                self.changed.wait(left)


_CONTROL = re.compile(rb"\x1b\[([0-9;?]*)([A-Za-z])|\x1b\][^\x07]*\x07|\r|\n|\x08")


def screen(data: bytes) -> list[str]:
    """The lines a terminal shows after ``data``: text, ``\\r``, ``\\n``, erase, cursor moves."""
    rows: list[list[str]] = [[]]
    row = column = 0
    position = 0
    for match in [*_CONTROL.finditer(data), None]:
        end = match.start() if match is not None else len(data)
        for char in data[position:end].decode(errors="replace"):
            line = rows[row]
            line.extend(" " * (column - len(line) + 1))
            line[column] = char
            column += 1
        if match is None:
            break
        position = match.end()
        token, final = match.group(0), match.group(2)
        if token == b"\r":
            column = 0
        elif token == b"\n":
            row += 1
        elif token == b"\x08":
            column = max(0, column - 1)
        elif final == b"K":
            mode = match.group(1)
            rows[row] = [] if mode == b"2" else rows[row][:column]
        elif final == b"A":
            row = max(0, row - int(match.group(1) or 1))
        elif final == b"G":
            column = int(match.group(1) or 1) - 1
        while len(rows) <= row:
            rows.append([])
    return ["".join(line).rstrip() for line in rows]


def _set_size(fd: int, columns: int, lines: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))


def test_rank_zero_bars_draw_live_and_unprefixed_in_a_terminal(tmp_path: Path) -> None:
    script = tmp_path / "bars.py"
    script.write_text(BARS)
    controller, terminal = pty.openpty()
    _set_size(terminal, COLUMNS, LINES)
    env = {**os.environ, "TERM": "xterm-256color"}
    for name in ("RINGPLUG_MPIEXEC", TERMINAL_VARIABLE):
        env.pop(name, None)
    job = subprocess.Popen(
        [*RINGRUN, "-np", "2", sys.executable, str(script), str(tmp_path)],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env=env,
        start_new_session=True,
    )
    os.close(terminal)
    reader = _TerminalReader(controller)
    reader.start()
    try:
        # Rank 0 waits at step 3 until the test has seen it: the update is live.
        reader.wait_for(b"tqdm 3/10")
        assert job.poll() is None
        (tmp_path / "go-tqdm").touch()
        reader.wait_for(b"rich 3/10")
        assert job.poll() is None
        (tmp_path / "go-rich").touch()
        assert job.wait(timeout=60) == 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait(timeout=10)
    reader.join(10)
    os.close(controller)
    raw = bytes(reader.data)
    shown = screen(raw)
    text = "\n".join(shown)
    # Rank 0 writes to a terminal of ringrun's size, and nothing it writes is prefixed.
    assert f"rank zero isatty=True,True size={COLUMNS}x{LINES} term=xterm-256color" in shown
    assert not re.search(r"\[0\]|\[\d+,0\]", raw.decode(errors="replace"))
    # Every tqdm update reached the terminal as tqdm drew it, and the last one stays.
    for step in range(1, 11):
        assert f"\rtqdm {step}/10|".encode() in raw
    assert "tqdm 10/10|##########|" in shown, text
    assert any(line.startswith("rich 10/10 ") for line in shown), text
    assert "rank zero done" in shown
    # Rank 1's line keeps its label and a line of its own, wherever it fell among the bars.
    assert any(labelled(1, "rank one isatty=False").fullmatch(line) for line in shown), text


def test_piped_ringrun_keeps_every_line_prefixed(tmp_path: Path) -> None:
    script = tmp_path / "lines.py"
    script.write_text(
        "import os, sys\n"
        "rank = os.environ.get('PMI_RANK') or os.environ['OMPI_COMM_WORLD_RANK']\n"
        "print('isatty', sys.stdout.isatty(), 'rank', rank, flush=True)\n"
    )
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("RINGPLUG_MPIEXEC", None)
    result = subprocess.run(
        [*RINGRUN, "-np", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    assert len(lines) == 2, result.stdout
    for rank, line in enumerate(lines):
        assert labelled(rank, f"isatty False rank {rank}").fullmatch(line), line


def test_wrapper_sends_rank_zero_terminal_bytes_as_output_events(tmp_path: Path) -> None:
    program = (
        "import os, sys\n"
        "size = os.get_terminal_size(1)\n"
        "sys.stdout.write(f'\\r{size.columns}x{size.lines} {sys.stdout.isatty()}\\r\\x1b[K')\n"
        "sys.stdout.flush()\n"
        "print('err', sys.stderr.isatty(), file=sys.stderr)\n"
    )
    env = {
        **os.environ,
        "PMI_RANK": "0",
        "PMI_SIZE": "1",
        EVENTS_VARIABLE: "tok",
        TERMINAL_VARIABLE: TerminalSpec(("stdout",), 61, 17).to_variable(),
    }
    result = subprocess.run(
        [sys.executable, "-m", "ringplug.run.launch.wrapper", "--", sys.executable, "-c", program],
        capture_output=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    events = [parse_event(line, "tok") for line in result.stdout.decode().splitlines()]
    assert all(isinstance(event, RankOutput) and event.rank == 0 for event in events), events
    assert b"".join(event.data for event in events) == b"\r61x17 True\r\x1b[K"
    # stderr was not asked for: it stays a pipe, its lines plain.
    assert b"err False\n" in result.stderr


def test_other_ranks_line_goes_above_rank_zeros_unfinished_line() -> None:
    read_end, write_end = os.pipe()
    sink = TerminalSink(write_end)
    sink.raw(b"epoch 1\n\r 40%|####")
    sink.line(b"[1] warning\n")
    sink.raw(b"\r 50%|#####")
    sink.finish()
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        written = pipe.read()
    assert written == (
        b"epoch 1\n\r 40%|####" + b"\r\x1b[K[1] warning\n\r 40%|####" + b"\r 50%|#####" + b"\n"
    )
    assert screen(written) == ["epoch 1", "[1] warning", " 50%|#####", ""]


def test_other_ranks_lines_pass_unchanged_when_rank_zero_is_at_a_line_start() -> None:
    read_end, write_end = os.pipe()
    sink = TerminalSink(write_end)
    sink.raw(b"done\n")
    sink.line(b"[1] partial")
    sink.finish()
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        assert pipe.read() == b"done\n[1] partial"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("stdout,stderr 120x40 xterm", TerminalSpec(("stdout", "stderr"), 120, 40, "xterm")),
        ("stderr 80x24", TerminalSpec(("stderr",), 80, 24)),
        ("stdin 80x24", None),
        ("stdout 80by24", None),
        ("", None),
    ],
)
def test_terminal_variable_is_read_strictly(value: str, expected: TerminalSpec | None) -> None:
    assert TerminalSpec.from_environment({TERMINAL_VARIABLE: value}) == expected
    if expected is not None:
        again = {TERMINAL_VARIABLE: expected.to_variable()}
        assert TerminalSpec.from_environment(again) == expected


# Progress bars as Keras's Progbar draws them outside a notebook (its dynamic display is on
# wherever `posix` is imported): backspaces over the last bar, a carriage return, the new
# bar, a newline at the end. Then tqdm's way: a carriage return before each bar. All in one
# write, so that no pause of the program shows a bar before its end (a partial line).
REDRAWS = r"""
import os

out, width = "", 0
for step in (1, 2, 3):
    bar = f"{step}/3 {'=' * step} - loss: {1 / step:.4f}"
    out += "\b" * width + "\r" + bar
    width = len(bar)
out += "\n" + "".join(f"\rtqdm {step}/3" for step in (1, 2, 3)) + "\n"
os.write(1, (out + f"rank {os.environ['RANK']} done\n").encode())
"""


def test_redrawn_bars_in_a_file_give_one_labelled_line_per_redraw(tmp_path: Path) -> None:
    script = tmp_path / "redraws.py"
    script.write_text(REDRAWS)
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("RINGPLUG_MPIEXEC", None)
    with (tmp_path / "out.txt").open("wb") as out:
        result = subprocess.run(
            [*RINGRUN, "-np", "2", sys.executable, str(script)],
            stdout=out,
            stderr=subprocess.PIPE,
            timeout=60,
            env=env,
            check=False,
        )
    assert result.returncode == 0, result.stderr
    written = (tmp_path / "out.txt").read_bytes().decode()
    # Each line carries exactly one label: a bar's carriage return used to leave "[0] " with
    # nothing after it, and the next redraw's label beside it ("[0] [0] 1/3 ...").
    assert "\r" not in written and "\b" not in written, repr(written)
    for rank in (0, 1):
        mine = [line for line in written.splitlines() if line.startswith(f"[{rank}] ")]
        for line in written.splitlines():
            assert len(re.findall(r"\[\d\] ", line)) == 1, repr(line)
        assert [line.removeprefix(f"[{rank}] ") for line in mine] == [
            "1/3 = - loss: 1.0000",
            "2/3 == - loss: 0.5000",
            "3/3 === - loss: 0.3333",
            "tqdm 1/3",
            "tqdm 2/3",
            "tqdm 3/3",
            f"rank {rank} done",
        ], repr(written)
