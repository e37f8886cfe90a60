"""RingLauncher: `python train.py` with `devices=N` runs N ranks of one MPI world, for
`Fabric(strategy="ring", devices=N)` and `Trainer(strategy="ring", devices=N)`.

Lightning's own launchers would start N processes that are each an MPI world of one (N
models training apart, silently). Instead, this process re-runs its own command line under
`ringrun -np N` (one MPI world), supervises it, and exits with the job's status; the ranks,
started by the launcher, take the external path and train. What they run, and where, is
`ringplug.run.launch.rerun.rank_command`: the script through `ringplug.run.launch.rerun`
(which keeps what this process printed for rank 0 before ``fit`` from being printed again),
and a Hydra app in this run's output folder.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from typing import Any

from lightning.fabric.strategies.launchers.launcher import _Launcher

from ..run.launch.processes import parent_death_signal
from ..run.launch.rerun import rank_command

# Variables an MPI singleton in this process may have set; the job's ranks get fresh ones.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPI_LOCAL", "HYDRA_", "OMPI_")


class RingLauncher(_Launcher):
    """Starts `ranks` copies of this script in one MPI world and waits for them."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.process: subprocess.Popen | None = None

    @property
    def is_interactive_compatible(self) -> bool:
        return False  # it re-runs the script, which a notebook doesn't have

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        program, cwd = rank_command()
        command = [sys.executable, "-m", "ringplug.run.cli", "-np", str(self.ranks), "--", *program]
        env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
        print(f"ringplug: starting {self.ranks} ranks: {shlex.join(command)}", flush=True)
        # If this supervisor dies, ringrun gets SIGTERM and stops the ranks.
        self.process = subprocess.Popen(
            command, env=env, cwd=cwd, preexec_fn=parent_death_signal(signal.SIGTERM)
        )
        returncode = self.process.wait()
        # The ranks did the work (and ran the rest of the script, the function given to
        # `fabric.launch` included); this process only supervised them, and ends with
        # their status.
        sys.stdout.flush()
        os._exit(returncode)

    def kill(self, signum: Any) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)
