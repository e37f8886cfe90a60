"""The tests' multi-host bed: ringplug.bench.netbed's bed with hosts that differ as a real
cluster's do, and hosts that are broken in given ways.

Hosts (:data:`HOSTS`): ``a``, ``b``, ``c`` are healthy; each names its link differently
(``enp6s0``, ``eth1``, ``ens3``) and has a ``docker0`` decoy with Docker's address, and host
``a`` a ``virbr0`` on a network no other host has; ``nossh`` has an address but no sshd;
``nopython`` runs sshd in a mount namespace where the virtualenv's directory is an empty
tmpfs; :data:`UNREACHABLE` is an address on the bed's network that nobody has.
"""

from __future__ import annotations

from ringplug.bench import netbed
from ringplug.bench.netbed import SUBNET, BedUnavailable, HostSpec

__all__ = ["HOSTS", "UNREACHABLE", "BedUnavailable", "NetBed"]

UNREACHABLE = f"{SUBNET}.99"

HOSTS = (
    HostSpec("a", "enp6s0", f"{SUBNET}.1", extra_decoy=True),
    HostSpec("b", "eth1", f"{SUBNET}.2"),
    HostSpec("c", "ens3", f"{SUBNET}.3"),
    HostSpec("nossh", "eth0", f"{SUBNET}.4", sshd=False),
    HostSpec("nopython", "eth0", f"{SUBNET}.5", hide_python=True),
)


class NetBed(netbed.NetBed):
    """The bed of :data:`HOSTS`, unshaped: build with `start`, always end with `stop`."""

    def __init__(self) -> None:
        super().__init__(HOSTS)
