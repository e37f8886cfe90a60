"""Multi-rank worker: several worker scripts, one after the other, in the same ranks.

``python in_turn.py SCRIPT ARGS... [+ SCRIPT ARGS...]``: each SCRIPT (a file beside this one)
runs as ``__main__`` with its ARGS, as ``python SCRIPT ARGS`` would, so that one job pays the
interpreter's start and the frameworks' imports once for all of them (on a 2-core machine
that is most of a short job). A script that raises, or exits with a status other than 0,
ends the rank with that failure, as on its own.

Before each script a rank prints ``in_turn: N SCRIPT begins`` (N counts from 0) on its
stdout and its stderr, so that a test can tell each script's output from the others'.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def runs(argv: list[str]) -> list[list[str]]:
    """``["a.py", "x", "+", "b.py"]`` -> ``[["a.py", "x"], ["b.py"]]``."""
    found: list[list[str]] = [[]]
    for arg in argv:
        if arg == "+":
            found.append([])
        else:
            found[-1].append(arg)
    if not all(found):
        raise SystemExit("usage: in_turn.py SCRIPT ARGS... [+ SCRIPT ARGS...]")
    return found


def main(argv: list[str]) -> None:
    for index, (script, *args) in enumerate(runs(argv)):
        for stream in (sys.stdout, sys.stderr):
            print(f"in_turn: {index} {script} begins", file=stream, flush=True)
        path = str(Path(__file__).parent / script)
        sys.argv = [path, *args]
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as stop:  # sys.exit(0) ends that script only
            if stop.code not in (None, 0):
                raise


if __name__ == "__main__":
    main(sys.argv[1:])
