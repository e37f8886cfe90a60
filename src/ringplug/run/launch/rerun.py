"""How the ranks of a self-launch run the user's script: ``python -m ringplug.run.launch.rerun
(SCRIPT | -m MODULE | -c CODE) [args...]``, as ``python SCRIPT args...`` would.

`Trainer(strategy="ring", devices=N)` (or Fabric's) started from a plain ``python train.py``
re-runs the script as N ranks (`ringplug.fabric.launcher.RingLauncher`). The process that
did so has already run everything before ``fit`` and printed what rank 0 prints there (the
config, "Instantiating model ...", Lightning's device summary). So the ranks replay that part
quietly: until the strategy starts the ring in ``fit`` (`end_replay`), Lightning's
``rank_zero_only`` lets no rank through, rank 0 included, as Lightning's own launcher
keeps its children quiet while the parent speaks for rank 0. Everything else about the
rank is true from the first line: ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (ringrun's
wrapper sets them), and the script runs as ``__main__`` with ``sys.argv`` and ``sys.path``
as Python sets them.

Standard library only until the script runs (and ``lightning_utilities``, which Lightning
brings, when it is installed; Hydra's config, in the launching process of a Hydra app).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

# `rank_zero_only.rank` while the ranks replay: no rank is rank zero. Not a rank's number,
# so that a message prefixed with it ("[rank: -1]") is not taken for another rank's.
REPLAY_RANK = -1

_replaying = False


def replaying() -> bool:
    """Whether this rank still replays the part of the script before ``fit``."""
    return _replaying


def end_replay(rank: int) -> None:
    """The strategy has started the ring: from here on, `rank` speaks as itself."""
    global _replaying
    if _replaying:
        _replaying = False
        _set_rank_zero_only(rank)


def _set_rank_zero_only(rank: int) -> None:
    try:
        from lightning_utilities.core.rank_zero import rank_zero_only
    except ImportError:  # not a Lightning program
        return
    # Lightning reads it at its first import only if it is not set (getattr with a default).
    rank_zero_only.rank = rank


def rank_command() -> tuple[list[str], str | None]:
    """What the ranks of this process's self-launch run, and the folder they start in (None:
    this one): the interpreter and its options, then ``-m ringplug.run.launch.rerun`` and the
    program with its arguments, as `split_command` finds them. A command line it cannot
    split runs as it is.

    A Hydra app (``@hydra.main``, as lightning-hydra-template) gets what Lightning's own
    launcher gives its ranks: this run's output folder as theirs (``hydra.run.dir``, so logs
    and checkpoints land in one place), no second copy of its ``.hydra`` config
    (``hydra.output_subdir=null``), and the folder it was started from as their working
    directory. A ``--multirun`` sweep is refused: it runs under ringrun instead.
    """
    split = split_command()
    if split is None:
        return list(getattr(sys, "orig_argv", [sys.executable, *sys.argv])), None
    interpreter, program = split
    cwd = None
    hydra = hydra_run(program)
    if hydra is not None:
        program, cwd = hydra
    return [*interpreter, "-m", "ringplug.run.launch.rerun", *program], cwd


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


def main(argv: Sequence[str] | None = None) -> None:
    """Run the script, module or code in `argv` as ``python`` would, replaying quietly."""
    global _replaying
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.exit(
            "usage: python -m ringplug.run.launch.rerun (SCRIPT | -m MODULE | -c CODE) [args...]"
        )
    _replaying = True
    _set_rank_zero_only(REPLAY_RANK)
    if args[0] == "-m" and len(args) > 1:
        sys.argv = [args[1], *args[2:]]  # run_module puts the module's path in argv[0]
        sys.path[0] = os.getcwd()  # as `python -m` does
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c" and len(args) > 1:
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))  # as `python SCRIPT` does
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    # Run as the module of its own name, whose `replaying` the strategies read (run as
    # __main__, this file would be a second module with a state of its own).
    from ringplug.run.launch import rerun

    rerun.main()
