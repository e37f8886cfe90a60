"""Helpers for tests that start ``ringrun``: run it bounded, fake launchers, find leftovers."""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

# The same names as ringplug.run.hosts.spec.LAUNCHER_HOSTFILE_VARIABLES (not imported: the
# helpers stay light).
LAUNCHER_HOSTFILE_VARIABLES = (
    "OMPI_MCA_orte_default_hostfile",
    "HYDRA_HOST_FILE",
    "I_MPI_HYDRA_HOST_FILE",
)

RINGRUN = [sys.executable, "-m", "ringplug.run.cli"]
"""``ringrun`` as this interpreter runs it, so it finds the virtualenv's mpiexec."""

# Found without importing ringplug, so the helpers stay light.
SOURCE_DIR = str(Path(importlib.util.find_spec("ringplug").origin).resolve().parents[1])

# No test waits longer than this for ringrun; a hang fails the test instead of the suite.
DEFAULT_TIMEOUT_S = 60.0


def run_ringrun(
    *args: str,
    env: Mapping[str, str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    cwd: str | Path | None = None,
    ringrun: Sequence[str] = RINGRUN,
) -> subprocess.CompletedProcess[str]:
    """Run ``ringrun args...`` to completion (bounded by ``timeout``) and capture its output.

    ``env`` replaces the environment; ``extra_env`` adds to it (or to ``os.environ``).
    """
    environment = dict(os.environ if env is None else env)
    if env is None:
        # A developer's own override must not change what the tests exercise, nor a
        # hostfile variable the launcher would read (ringrun does too).
        for name in ("RINGPLUG_MPIEXEC", *LAUNCHER_HOSTFILE_VARIABLES):
            environment.pop(name, None)
    environment.update(extra_env or {})
    return subprocess.run(
        [*ringrun, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=cwd,
        check=False,
    )


def unique_marker(scenario: str) -> str:
    """A string to put in a rank's argv, so leftover processes can be found by it."""
    return f"ringrun-test-{scenario}-{uuid.uuid4().hex[:12]}"


def processes_matching(marker: str, within_s: float = 0.0) -> list[str]:
    """Command lines of running processes whose argv contains ``marker``; with `within_s`,
    those still running after waiting up to that long for them to end (a launcher's
    process on another host may still be exiting when the launcher returns)."""
    import time

    deadline = time.monotonic() + within_s
    while True:
        result = subprocess.run(
            ["pgrep", "-af", marker], capture_output=True, text=True, timeout=10, check=False
        )
        found = [line for line in result.stdout.splitlines() if line.strip()]
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def write_executable(path: Path, text: str) -> Path:
    """Write a script and make it executable."""
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_open_mpi(directory: Path) -> Path:
    """An ``mpiexec`` that claims to be Open MPI 5.0.3 and runs nothing."""
    return write_executable(
        directory / "mpiexec",
        '#!/bin/sh\nif [ "$1" = "--version" ]; then\n'
        '  echo "mpiexec (Open MPI) 5.0.3"\n  echo\n'
        '  echo "Report bugs to https://www.open-mpi.org/community/help/"\n  exit 0\nfi\n'
        'echo "fake Open MPI cannot run anything" >&2\nexit 1\n',
    )


def python_without_mpi(directory: Path) -> tuple[Path, dict[str, str]]:
    """An interpreter with ringplug importable but no mpiexec beside it or on ``PATH``.

    Returns the interpreter and an environment to run it with. It is a symlink to the real
    interpreter in an empty directory, so ringrun's search beside ``sys.executable`` finds
    nothing; the virtualenv's packages come through ``PYTHONPATH``.
    """
    import sysconfig

    bin_dir = directory / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.symlink_to(Path(sys.executable).resolve())
    env = {
        "PATH": str(bin_dir),
        "PYTHONPATH": os.pathsep.join([SOURCE_DIR, sysconfig.get_paths()["purelib"]]),
        "HOME": os.environ.get("HOME", "/tmp"),
    }
    return python, env


def torchrun_workers_refused(output: str, workers: int) -> bool:
    """Whether every worker of a `torchrun --nproc-per-node WORKERS` job said that torchrun
    started it (ringplug's refusal), or was stopped by torchrun (SIGTERM), which it does to
    the others as soon as one worker fails: one importing a framework on a busy machine can
    be seconds behind. At least one must have said it."""
    said = [
        f"was started by torchrun as rank {rank} of {workers}" in output for rank in range(workers)
    ]
    stopped = [
        re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*exitcode\s*: -15 ", output)
        is not None
        for rank in range(workers)
    ]
    return any(said) and all(s or t for s, t in zip(said, stopped, strict=True))


def discovery_script(folder: Path, *answers: str) -> Path:
    """A ``--host-discovery-script`` that gives `answers` in turn (the last one from then
    on), e.g. ``"localhost:3", "localhost:2"``; each call's time (``date +%s.%N``) is
    appended to ``folder/discovered``."""
    script = folder / "discover.sh"
    lines = "\n".join(f"  {n}) echo '{answer}' ;;" for n, answer in enumerate(answers[:-1]))
    script.write_text(
        "#!/bin/sh\n"
        f"date +%s.%N >> {folder}/discovered\n"
        f"count=$(cat {folder}/calls 2>/dev/null || echo 0)\n"
        f"echo $((count + 1)) > {folder}/calls\n"
        f"case \"$count\" in\n{lines}\n  *) echo '{answers[-1]}' ;;\nesac\n"
    )
    script.chmod(0o755)
    return script


def helpers_left(folder: Path, pattern: str = "children.*", bound_s: float = 10.0) -> list[str]:
    """The helpers recorded in `folder` (files matching `pattern`, lines of ``pid start-time``,
    as tests/workers/children.py writes them) still running after waiting up to `bound_s`
    for them to end, each as ``pid (file)``."""
    import time

    recorded = [
        (path.name, *line.split())
        for path in sorted(folder.glob(pattern))
        if not path.name.endswith(".partial")
        for line in path.read_text().splitlines()
    ]
    assert recorded, f"no helper was recorded in {folder}"
    deadline = time.monotonic() + bound_s
    while True:
        left = [f"{pid} ({name})" for name, pid, start in recorded if _running(int(pid), start)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _running(pid: int, start: str) -> bool:
    """Whether process `pid`, started at `start` (``/proc``'s clock ticks), still runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0] not in ("Z", "X") and fields[19] == start
