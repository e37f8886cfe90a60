"""torch.distributed's rendezvous over ringplug's MPI world: a store, and gloo/NCCL groups.

``ringplug.torch.backend`` uses the store for ``init_process_group("ringplug")`` under an MPI
launcher (no MASTER_ADDR/MASTER_PORT needed); ``ringplug-bench`` starts gloo and NCCL groups
with it to compare against. The store's address travels over MPI.

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
from ..run.netinfo import local_interfaces


def mpi_store(timeout: datetime.timedelta) -> tuple[dist.Store, int, int]:
    """A TCPStore served by rank 0 at an address every rank learns over MPI, with this
    process's rank and the world size (what torch's rendezvous handlers yield)."""
    runtime.init()
    address = None
    server = None
    if runtime.rank() == 0:
        one_host = runtime.local_size() == runtime.size()
        host = "127.0.0.1" if one_host else rendezvous_address()
        server = dist.TCPStore(host, 0, runtime.size(), True, timeout, wait_for_workers=False)
        address = (host, server.port)
    host, port = core.broadcast_object(address, 0, name="ringplug.store-address")
    store = server or dist.TCPStore(host, port, runtime.size(), False, timeout)
    return store, runtime.rank(), runtime.size()


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


def destroy_gloo_group() -> None:
    """Stop the group (every rank together: gloo's threads must end before exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
