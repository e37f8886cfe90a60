"""RingLauncher for the Trainer: Fabric's `ringplug.fabric.launcher.RingLauncher` (which re-runs
the script under ``ringrun -np N``), as the Trainer's kind of launcher (it can also `kill`)."""

from __future__ import annotations

from lightning.pytorch.strategies.launchers.launcher import _Launcher

from ..fabric.launcher import RingLauncher as _RingLauncher


class RingLauncher(_RingLauncher, _Launcher):
    """Starts `ranks` copies of this script in one MPI world and waits for them."""


__all__ = ["RingLauncher"]
