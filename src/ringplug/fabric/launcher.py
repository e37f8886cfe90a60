"""RingLauncher: `python train.py` with `devices=N` runs N ranks of one MPI world, for
`Fabric(strategy="ring", devices=N)` and `Trainer(strategy="ring", devices=N)`.

Lightning's own launchers would start N processes that are each an MPI world of one (N
models training apart, silently). Instead, this process re-runs the exact command line
under `ringrun -np N` (one MPI world), supervises it, and exits with the job's status;
the ranks, started by the launcher, take the external path and train. They run the script
through `ringplug.run.rerun`, which keeps what this process already printed for rank 0
(everything before ``fit``) from being printed again.

A Hydra app (``@hydra.main``, as lightning-hydra-template) gets what Lightning's own
launcher gives its ranks: this run's output folder as theirs (``hydra.run.dir``, so logs and
checkpoints land in one place), no second copy of its ``.hydra`` config
(``hydra.output_subdir=null``), and the folder it was started from as their working
directory. A ``--multirun`` sweep is refused: it runs under ringrun instead.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from typing import Any

from lightning.fabric.strategies.launchers.launcher import _Launcher

from ..run.processes import parent_death_signal

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
        command = [sys.executable, "-m", "ringplug.run.cli", "-np", str(self.ranks), "--"]
        cwd = None
        split = split_command()
        if split is None:  # options it cannot split: the ranks run it as it is
            command += getattr(sys, "orig_argv", [sys.executable, *sys.argv])
        else:
            interpreter, program = split
            hydra = hydra_run(program)
            if hydra is not None:
                program, cwd = hydra
            command += [*interpreter, "-m", "ringplug.run.rerun", *program]
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


def split_command() -> tuple[list[str], list[str]] | None:
    """This process's command line as (the interpreter and its options, the program: the
    script, ``-m module`` or ``-c code``, with its arguments); None when an option joined
    to ``-m`` or ``-c`` (``python -um module``) hides where the program starts."""
    original = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    start = len(original) - len(sys.argv)  # the script's (or module's, or code's) place
    if start < 1:
        return None
    if original[start - 1] in ("-m", "-c"):
        start -= 1
    elif original[start - 1].startswith("-") and not original[start - 1].startswith("--"):
        return None
    return original[:start], original[start:]


def hydra_run(program: list[str]) -> tuple[list[str], str] | None:
    """The ranks' `program` and working folder for this Hydra run (its output folder as
    theirs), or None when this process is not inside ``@hydra.main``."""
    if "hydra" not in sys.modules:
        return None
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    config = HydraConfig.get()
    # The script as the folder it was started from names it (the ranks start there).
    target = program[:2] if program[0] in ("-m", "-c") else [program[0]]
    arguments = program[len(target) :]
    if config.mode == RunMode.MULTIRUN:
        # The sweep's jobs run one after another in this process, which ends with the ranks.
        raise NotImplementedError(
            "A Hydra --multirun sweep cannot start its own ranks (strategy='ring' with "
            "devices=N): this process would end with the first job's ranks. "
            "Start the sweep under ringrun instead, each rank running every job: `ringrun -np "
            "N python train.py --multirun ...` with devices left at its default."
        )
    options, overrides = _hydra_arguments(arguments)
    overrides = [o for o in overrides if not o.lstrip("+").startswith(_HYDRA_REPLACED)]
    folder = _hydra_quoted(str(config.runtime.output_dir))
    ranks = [*target, *options, *overrides, f"hydra.run.dir={folder}", "hydra.output_subdir=null"]
    return ranks, str(config.runtime.cwd)


# Hydra's own command-line options that take a value, which the ranks keep; `--multirun`
# they drop, and the settings the ranks get from this run (`hydra_run`) replace the ones given.
_HYDRA_VALUE_OPTIONS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
_HYDRA_DROPPED = ("-m", "--multirun")
_HYDRA_REPLACED = ("hydra.run.dir=", "hydra.output_subdir=")


def _hydra_arguments(arguments: list[str]) -> tuple[list[str], list[str]]:
    """A Hydra app's `arguments` as (the options the ranks keep: config path, name and
    folder, with their values; the overrides), without ``--multirun``."""
    options: list[str] = []
    overrides: list[str] = []
    taking = False
    for argument in arguments:
        if taking or argument.startswith(tuple(f"{o}=" for o in _HYDRA_VALUE_OPTIONS)):
            options.append(argument)
            taking = False
        elif argument in _HYDRA_VALUE_OPTIONS:
            options.append(argument)
            taking = True
        elif argument not in _HYDRA_DROPPED:
            overrides.append(argument)
    return options, overrides


def _hydra_quoted(path: str) -> str:
    """`path` as a Hydra override value: quoted, so that ``=``, ``,`` or spaces in it stay."""
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'
