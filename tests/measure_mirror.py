"""Measure what mirroring costs per process: importing ringplug.lightning's and ringplug.fabric's
files as ringplug.pytorch_lightning / ringplug.lightning_fabric, next to importing the same
files plainly.

    PYTHONPATH=src python tests/measure_mirror.py [--repeats 21]

Prints the median milliseconds, all files of both packages together, for: compiling them
from source (a plain import without bytecode), the mirror's rewrite and compile (no cache),
loading regular bytecode, and the mirror's cached code. Not a test: it only prints.
"""

from __future__ import annotations

import argparse
import marshal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import ringplug
from ringplug import _mirror

ROOT = Path(ringplug.__file__).parent
TARGETS = {"lightning": "ringplug.pytorch_lightning", "fabric": "ringplug.lightning_fabric"}
FILES = [
    (path, f"ringplug.{package}" + ("" if path.stem == "__init__" else f".{path.stem}"), package)
    for package in TARGETS
    for path in sorted((ROOT / package).glob("*.py"))
]


def median_ms(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def mirror_all() -> None:
    for path, name, package in FILES:
        _mirror._code(path, name, path.stem == "__init__", TARGETS[package], _mirror.STANDALONE)


def clear_mirror_caches() -> None:
    for path, _, package in FILES:
        tag = "".join(c for c in TARGETS[package] if c.isalnum())
        for cache in (path.parent / "__pycache__").glob(f"{path.stem}.*.opt-{tag}.pyc"):
            cache.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    repeats = parser.parse_args().repeats
    sources = {path: path.read_bytes() for path, _, _ in FILES}
    bytecode = {
        p: marshal.dumps(compile(s, str(p), "exec", dont_inherit=True)) for p, s in sources.items()
    }
    lines = sum(s.count(b"\n") for s in sources.values())
    print(f"{len(FILES)} files, {lines} lines; median of {repeats}, ms")
    clear_mirror_caches()
    sys.dont_write_bytecode = True
    rows = [
        (
            "plain import, compiled from source",
            lambda: [compile(s, str(p), "exec", dont_inherit=True) for p, s in sources.items()],
        ),
        ("mirror, rewritten and compiled (no cache)", mirror_all),
        (
            "plain import, from bytecode",
            lambda: [(p.read_bytes(), marshal.loads(bytecode[p])) for p in sources],
        ),
    ]
    for label, work in rows:
        print(f"{label:45} {median_ms(work, repeats):8.2f}")
    sys.dont_write_bytecode = False
    mirror_all()  # fills the cache
    sys.dont_write_bytecode = True
    print(f"{'mirror, from its cache':45} {median_ms(mirror_all, repeats):8.2f}")
    clear_mirror_caches()


if __name__ == "__main__":
    main()
