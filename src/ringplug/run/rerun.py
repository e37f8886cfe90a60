"""How the ranks of a self-launch run the user's script: ``python -m ringplug.run.rerun
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
brings, when it is installed).
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


def main(argv: Sequence[str] | None = None) -> None:
    """Run the script, module or code in `argv` as ``python`` would, replaying quietly."""
    global _replaying
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.exit("usage: python -m ringplug.run.rerun (SCRIPT | -m MODULE | -c CODE) [args...]")
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
    from ringplug.run import rerun

    rerun.main()
