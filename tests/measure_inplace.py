"""Measure whether the ranks left after a SIGKILL can re-form the world in place (MPI's
fault-tolerance extension, ULFM: ``Comm.Revoke`` and ``Comm.Shrink``) instead of being
started again by ``ringrun --max-restarts``, and how fast.

    python tests/measure_inplace.py [--runs 3]   # run with the venv of the MPI to measure

Three ranks of plain mpi4py; rank 2 SIGKILLs itself after 5 allreduces, the others go on
calling allreduce until one fails, then revoke, shrink and allreduce on the shrunk world.
Each run prints, per surviving rank, the seconds from the kill to the error and to the
first collective on the shrunk world, or how the job ended instead. Open MPI is started
with ``mpirun --with-ft ulfm``; MPICH with ``mpiexec -disable-auto-cleanup``, once without
and once with ``MPIR_CVAR_ENABLE_FT=1``. Not a test: the interpreter's MPI decides what
can run. Figures: docs/elastic.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RANK_PROGRAM = r"""
import os, signal, sys, time
from mpi4py import MPI
import numpy as np

world = MPI.COMM_WORLD
world.Set_errhandler(MPI.ERRORS_RETURN)
rank = world.Get_rank()
data = np.ones(1 << 18)
for _ in range(5):
    world.Allreduce(MPI.IN_PLACE, data)
marker = sys.argv[1]
if rank == 2:
    with open(marker, "w") as file:
        file.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.time() + 30
try:
    while time.time() < deadline:
        world.Allreduce(MPI.IN_PLACE, data)
    print(f"rank {rank}: no error within 30 s", flush=True)
except MPI.Exception as error:
    failed = time.time()
    world.Revoke()
    shrunk = world.Shrink()
    total = np.ones(1)
    shrunk.Allreduce(MPI.IN_PLACE, total)
    killed = float(open(marker).read())
    print(f"rank {rank}: error {error.Get_error_class()} after {failed - killed:.3f} s; "
          f"{shrunk.Get_size()} ranks, first collective {time.time() - killed:.3f} s "
          f"after the kill (sum {total[0]:g})", flush=True)
"""


def launchers() -> list[tuple[str, list[str], dict[str, str]]]:
    """(what, command prefix, extra environment) for the MPI beside this interpreter."""
    from mpi4py import MPI

    folder = Path(sys.executable).parent
    version = MPI.Get_library_version()
    if "Open MPI" in version:
        mpirun = shutil.which("mpirun", path=str(folder)) or "mpirun"
        prefix = [mpirun, "--allow-run-as-root", "--oversubscribe", "--with-ft", "ulfm"]
        return [("Open MPI, --with-ft ulfm", prefix, {})]
    mpiexec = shutil.which("mpiexec", path=str(folder)) or "mpiexec"
    prefix = [mpiexec, "-disable-auto-cleanup"]
    return [
        ("MPICH, -disable-auto-cleanup", prefix, {}),
        (
            "MPICH, -disable-auto-cleanup, MPIR_CVAR_ENABLE_FT=1",
            prefix,
            {"MPIR_CVAR_ENABLE_FT": "1"},
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "rank.py"
        program.write_text(RANK_PROGRAM)
        for what, prefix, extra in launchers():
            print(what)
            for run in range(runs):
                marker = Path(folder) / f"killed.{run}"
                result = subprocess.run(
                    [*prefix, "-n", "3", sys.executable, str(program), str(marker)],
                    capture_output=True,
                    text=True,
                    timeout=90,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **extra},
                    check=False,
                )
                lines = [line for line in result.stdout.splitlines() if line.startswith("rank")]
                if not lines:
                    said = [line for line in result.stderr.splitlines() if line.strip()]
                    lines = [
                        f"no survivor went on (exit {result.returncode}): "
                        + (said[0][:120] if said else "nothing said")
                    ]
                for line in lines:
                    print(f"  run {run + 1}: {line}")


if __name__ == "__main__":
    main()
