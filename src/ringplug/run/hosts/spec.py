"""Host lists for ``ringrun``: ``-H a:2,b:2`` and hostfiles, parsed into slots per host."""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ringplug.run.settings import read_text_file

logger = logging.getLogger(__name__)

_SLOTS_KEYWORD = re.compile(r"^slots\s*=\s*(\S+)$")

# Set inside batch allocations; there the launcher asks the scheduler where to put ranks and
# starts them through it, not through ssh.
_ALLOCATION_VARIABLES = (
    "SLURM_JOB_NODELIST",
    "PBS_NODEFILE",
    "LSB_DJOB_HOSTFILE",
    "LSB_MCPU_HOSTS",
    "PE_HOSTFILE",
    "COBALT_NODEFILE",
)


# Variables that name the hostfile an MPI launcher reads when it is given no hosts, in the
# order ringrun looks at them. The Kubernetes MPI Operator (v2beta1) sets the one for the
# MPIJob's mpiImplementation in the launcher pod, to its mounted /etc/mpi/hostfile.
LAUNCHER_HOSTFILE_VARIABLES = (
    "OMPI_MCA_orte_default_hostfile",  # Open MPI (mpiImplementation: OpenMPI, the default)
    "HYDRA_HOST_FILE",  # MPICH's hydra (mpiImplementation: MPICH)
    "I_MPI_HYDRA_HOST_FILE",  # Intel MPI's hydra (mpiImplementation: Intel)
)


class HostSpecError(ValueError):
    """A host list or hostfile line that cannot be understood."""


@dataclass(frozen=True)
class Host:
    """One machine and the number of ranks (slots) it should run.

    Args:
        name: hostname or address, as the MPI launcher should reach it.
        slots: ranks to place on this host; at least 1.
    """

    name: str
    slots: int = 1

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def _parse_slots(text: str, where: str) -> int:
    """Turn a slot count into an int, with an error that names where it came from."""
    try:
        slots = int(text)
    except ValueError:
        raise HostSpecError(f"{where}: slot count {text!r} is not a whole number") from None
    if slots < 1:
        raise HostSpecError(f"{where}: slot count must be at least 1, got {slots}")
    return slots


def parse_host_entry(entry: str, where: str = "host") -> Host:
    """Parse one host written as ``host``, ``host:slots`` or ``host slots=N``."""
    text = entry.strip()
    if not text:
        raise HostSpecError(f"{where}: empty host name")
    parts = text.split()
    if len(parts) == 2:
        match = _SLOTS_KEYWORD.match(parts[1])
        if match is None:
            raise HostSpecError(f"{where}: expected 'host slots=N', got {text!r}")
        return Host(parts[0], _parse_slots(match.group(1), where))
    if len(parts) > 2:
        raise HostSpecError(
            f"{where}: expected 'host', 'host:slots' or 'host slots=N', got {text!r}"
        )
    if text.count(":") == 1:
        # Exactly one colon is host:slots; more than one is an IPv6 address without slots.
        name, slots = text.split(":")
        if not name:
            raise HostSpecError(f"{where}: empty host name in {text!r}")
        return Host(name, _parse_slots(slots, where))
    return Host(text, 1)


def parse_host_list(spec: str | Iterable[str]) -> list[Host]:
    """Parse ``-H`` style hosts: ``"a:2,b:2"`` or a list such as ``["a:2", "b slots=2"]``."""
    entries = spec.split(",") if isinstance(spec, str) else list(spec)
    hosts = [parse_host_entry(entry, where=f"host {entry.strip()!r}") for entry in entries]
    return merge_duplicates(hosts)


def parse_hostfile(path: str | Path, what: str = "hostfile") -> list[Host]:
    """Read a hostfile: one host a line as ``host``, ``host:slots`` or ``host slots=N``.

    ``#`` starts a comment; blank lines are skipped. A host listed twice gets the sum of its
    slots, as both MPI launchers would do. ``what`` names the file in errors.
    """
    path = Path(path)
    text = read_text_file(path, what, HostSpecError)
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(parse_host_entry(line, where=f"{path}:{number}"))
    if not hosts:
        raise HostSpecError(f"hostfile {path} lists no hosts")
    return merge_duplicates(hosts)


def launcher_hostfile(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The hostfile the MPI launcher would read on its own, as ``(variable, path)``.

    ``None`` when none of :data:`LAUNCHER_HOSTFILE_VARIABLES` is set.
    """
    for name in LAUNCHER_HOSTFILE_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def merge_duplicates(hosts: Iterable[Host]) -> list[Host]:
    """Add up the slots of hosts named more than once, keeping first-seen order."""
    slots: dict[str, int] = {}
    for host in hosts:
        slots[host.name] = slots.get(host.name, 0) + host.slots
    return [Host(name, count) for name, count in slots.items()]


def total_slots(hosts: Iterable[Host]) -> int:
    """Number of ranks the hosts can hold without oversubscribing."""
    return sum(host.slots for host in hosts)


def format_host_list(hosts: Iterable[Host]) -> str:
    """The ``a:2,b:2`` form both hydra (``-hosts``) and Open MPI (``-H``) understand."""
    return ",".join(str(host) for host in hosts)


def rank_hosts(hosts: Sequence[Host], np: int) -> list[str]:
    """The host each rank is expected on: each host's slots in order, then around again.

    Both hydra (``-hosts``) and Open MPI (``-H``, mapping by slot) place ranks this way.
    """
    names = [host.name for host in hosts for _ in range(host.slots)]
    return [names[rank % len(names)] for rank in range(np)] if names else []


def is_this_machine(name: str, hostname: str | None = None) -> bool:
    """Whether a host name from ``-H`` means the machine ringrun runs on.

    Compares names only (``localhost``, loopback addresses, this host's name, short or
    qualified); no DNS lookups, which can hang on a broken resolver.
    """
    own = (socket.gethostname() if hostname is None else hostname).lower()
    name = name.lower()
    if name in ("localhost", "::1") or name.startswith("127."):
        return True
    return name == own or name.split(".")[0] == own.split(".")[0]


def in_batch_allocation(environ: Mapping[str, str]) -> bool:
    """Whether ringrun runs inside a batch scheduler's allocation (Slurm, PBS, LSF, ...).

    There the MPI launchers start ranks through the scheduler rather than ssh.
    """
    return any(environ.get(name) for name in _ALLOCATION_VARIABLES)
