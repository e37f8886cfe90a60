"""torch.distributed's rendezvous over ringplug's MPI world: a store, and gloo/NCCL groups.

``ringplug.torch.backend`` uses the store for the ``ringplug`` group (``init_process_group
("ringplug")`` under an MPI launcher, with no MASTER_ADDR/MASTER_PORT, and RingStrategy's
start), where libraries keep their keys (and, under a torch older than 2.13, gloo groups
over some of the ranks meet);
``ringplug-bench`` starts gloo and NCCL groups with it to compare against. The store's address
travels over MPI.

Across hosts, rank 0's address comes from ``GLOO_SOCKET_IFNAME`` (torch's own variable for
gloo's interfaces, which ``ringrun`` sets per host to the interfaces it found routing between
the hosts), else from rank 0's hostname; a hostname that resolves to a loopback address
(Debian's ``127.0.1.1``) or not at all is an error that says what to set.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from ..core import collectives as core
from ..core import runtime
from ..core.errors import RingplugError
from ..run.hosts.netinfo import local_interfaces

# How long a rank tries to reach the store rank 0 serves before it gives up on it: the
# address travelled over MPI, so the server is listening already; only a network that does
# not route between the hosts keeps a rank waiting this long.
_CONNECT_SECONDS = 30.0


def mpi_store(timeout: datetime.timedelta) -> tuple[dist.Store, int, int]:
    """A TCPStore served by rank 0 at an address every rank learns over MPI, with this
    process's rank and the world size (what torch's rendezvous handlers yield).

    Raises `RingplugError` on every rank when rank 0 has no address the others can reach,
    or on the rank that cannot reach it.
    """
    store = job_store(timeout)
    if isinstance(store, UnreachableStore):
        raise RingplugError(store.reason)
    return store, runtime.rank(), runtime.size()


def job_store(timeout: datetime.timedelta) -> dist.Store:
    """The job's key-value store for torch.distributed: a TCPStore that rank 0 serves, its
    address sent over MPI; every ``get``/``wait`` on it has `timeout` as its deadline.

    Where it cannot be reached (rank 0 has no address the other hosts can route to, or
    this rank cannot connect), an `UnreachableStore` that says why on every use, so that
    a job that never needs the store still runs. Every rank must call this together.
    """
    runtime.init()
    offer: tuple[str, int] | str | None = None
    server = None
    if runtime.rank() == 0:
        one_host = runtime.local_size() == runtime.size()
        try:
            host = "127.0.0.1" if one_host else rendezvous_address()
            server = dist.TCPStore(host, 0, runtime.size(), True, timeout, wait_for_workers=False)
            offer = (host, server.port)
        except (RingplugError, RuntimeError, OSError) as exc:  # told to every rank below
            offer = f"rank 0 could not serve torch.distributed's store: {exc}"
    offer = core.broadcast_object(offer, 0, name="ringplug.store-address")
    if server is not None:
        return server
    if isinstance(offer, str):
        return UnreachableStore(offer)
    host, port = offer
    connect = datetime.timedelta(seconds=min(_CONNECT_SECONDS, timeout.total_seconds()))
    try:
        client = dist.TCPStore(host, port, runtime.size(), False, connect)
    except (RuntimeError, OSError) as exc:  # DistStoreError, DistNetworkError
        return UnreachableStore(
            f"rank {runtime.rank()} could not reach torch.distributed's store, which rank 0 "
            f"serves at {host}:{port}, within {connect.total_seconds():g} s ({exc}). Set "
            "GLOO_SOCKET_IFNAME to the network interface the hosts share (ringrun sets it "
            "when it chooses the interfaces)."
        )
    client.set_timeout(timeout)
    return client


class UnreachableStore(dist.Store):
    """The store of a job whose ranks cannot reach each other's TCPStore: every use raises
    `RingplugError` with the reason (what `dist.new_group` over some ranks, and code that
    reads the group's store, meet at once instead of waiting)."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise RingplugError(
            f"torch.distributed's store is not available on rank {runtime.rank()}: {self.reason}"
        )

    set = get = add = wait = compare_set = check = delete_key = num_keys = _refuse
    multi_get = multi_set = append = _refuse

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        pass  # torch sets it on every group's store; only a use is refused


def init_gloo_group(backend: str = "gloo") -> bool:
    """Start the default torch.distributed group over ringplug's ranks, unless one exists.

    `backend` is gloo (the default) or nccl (benchmarks compare against them).
    Returns whether this call created it (and so should destroy it).
    """
    if not dist.is_available() or dist.is_initialized():
        return False
    store, rank, size = mpi_store(datetime.timedelta(minutes=30))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    return True


def rendezvous_address() -> str:
    """An address of this host that ranks on other hosts can connect to (for rank 0)."""
    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    by_name = {interface.name: interface.address for interface in local_interfaces()}
    for name in names:
        if name in by_name:
            return by_name[name]
    hostname = socket.gethostname()
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        address = None
    if address is not None and not address.startswith("127."):
        return address
    resolved = f"resolves to {address}" if address else "does not resolve"
    raise RingplugError(
        f"Rank 0's hostname {hostname!r} {resolved}, so ranks on other hosts cannot reach the "
        "torch.distributed group ringplug sets up. Set GLOO_SOCKET_IFNAME to the network "
        "interface the hosts share (ringrun sets it when it chooses the interfaces), or fix "
        "the name in /etc/hosts or DNS."
    )
