"""A torch.distributed (gloo) group over the same ranks, for code that needs one.

torchmetrics' metric sync, SyncBatchNorm and parts of Lightning call torch.distributed
directly. Gradients keep going through ringplug's engine; this group only serves them.
Its rendezvous address travels over MPI, so no MASTER_ADDR/MASTER_PORT is needed.

Across hosts, rank 0's address comes from ``GLOO_SOCKET_IFNAME`` (torch's own variable for
gloo's interfaces, which ``ringrun`` sets per host to the interfaces it found routing between
the hosts), else from rank 0's hostname; a hostname that resolves to a loopback address
(Debian's ``127.0.1.1``) or not at all is an error that says what to set.
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch.distributed as dist

from ..core import collectives as core
from ..core import runtime
from ..core.errors import RingplugError
from ..run.netinfo import local_interfaces


def init_gloo_group(backend: str = "gloo") -> bool:
    """Start the default torch.distributed group over ringplug's ranks, unless one exists.

    `backend` is gloo (the default) or nccl (benchmarks compare against it on GPUs).
    Returns whether this call created it (and so should destroy it).
    """
    if not dist.is_available() or dist.is_initialized():
        return False
    address = None
    if runtime.rank() == 0:
        one_host = runtime.local_size() == runtime.size()
        host = "127.0.0.1" if one_host else rendezvous_address()
        with contextlib.closing(socket.socket()) as probe:
            probe.bind((host, 0))
            address = f"tcp://{host}:{probe.getsockname()[1]}"
    address = core.broadcast_object(address, 0, name="ringplug.gloo-address")
    dist.init_process_group(backend, init_method=address, rank=runtime.rank(),
                            world_size=runtime.size())  # fmt: skip
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
