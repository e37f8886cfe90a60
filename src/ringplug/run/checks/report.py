"""What ``ringrun --check`` reads and writes: the context its sections look at, and a section.

Its own module, so that the sections (:mod:`ringplug.run.checks.check`,
:mod:`ringplug.run.checks.gpu`) import it rather than each other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ringplug.run.checks.preflight import Preflight, run_preflight
from ringplug.run.hosts.spec import Host
from ringplug.run.hosts.ssh import HostProblem, SshOptions
from ringplug.run.launch.mpi import LauncherError, MpiLauncher, find_launcher, remote_executables
from ringplug.run.settings import DEFAULT_START_TIMEOUT_S


def _run_ldconfig() -> str:
    """The dynamic linker's library list, or ``""`` where ldconfig is unavailable."""
    for candidate in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            result = subprocess.run(
                [candidate, "-p"], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        return result.stdout
    return ""


@dataclass
class CheckContext:
    """Where the facts come from; tests replace parts of it.

    Args:
        environ: the environment (``PATH``, ``MPI4PY_LIBMPI``). Defaults to ``os.environ``.
        python: the interpreter the ranks use. Defaults to ``sys.executable``.
        prefix: the virtualenv (or installation) prefix. Defaults to ``sys.prefix``.
        ldconfig: returns ``ldconfig -p`` output. Defaults to running it.
        hosts: the job's hosts (``-H``, ``--hostfile``) to check too. Defaults to ``[]``
            (this machine only).
        ssh: how to reach them. Defaults to ssh's own configuration.
        network_interfaces: interface names the user gave. Defaults to ``[]`` (probe).
        host_timeout_s: how long each host gets to answer. Defaults to 60.
    """

    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    python: str = sys.executable
    prefix: str = sys.prefix
    ldconfig: Callable[[], str] = field(default_factory=lambda: _run_ldconfig)
    hosts: list[Host] = field(default_factory=list)
    ssh: SshOptions = field(default_factory=SshOptions)
    network_interfaces: list[str] = field(default_factory=list)
    host_timeout_s: float = DEFAULT_START_TIMEOUT_S
    _preflight: Preflight | None = field(default=None, init=False, repr=False)
    _launcher: MpiLauncher | None = field(default=None, init=False, repr=False)

    def launcher(self) -> MpiLauncher | None:
        """The MPI launcher ringrun would use (found once); ``None`` when there is none."""
        if self._launcher is None:
            try:
                self._launcher = find_launcher(self.environ, self.python)
            except LauncherError:
                return None
        return self._launcher

    def preflight(self) -> Preflight | None:
        """The hosts' preflight, run on first use; ``None`` without hosts."""
        if not self.hosts:
            return None
        if self._preflight is None:
            launcher = self.launcher()
            needed = [] if launcher is None else remote_executables(launcher)
            self._preflight = run_preflight(
                self.hosts,
                self.ssh,
                self.python,
                timeout_s=self.host_timeout_s,
                needed_files=needed,
                requested_interfaces=self.network_interfaces,
                mpi_library=True,
                environ=self.environ,
            )
        return self._preflight


@dataclass
class Section:
    """One titled block of the report: facts as (name, value) rows, warnings and problems."""

    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[HostProblem] = field(default_factory=list)
