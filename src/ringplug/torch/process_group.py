"""A torch.distributed (gloo) group over the same ranks, for code that needs one.

torchmetrics' metric sync, SyncBatchNorm and parts of Lightning call torch.distributed
directly. Gradients keep going through ringplug's engine; this group only serves them.
Its rendezvous address travels over MPI, so no MASTER_ADDR/MASTER_PORT is needed.
"""

from __future__ import annotations

import contextlib
import socket

import torch.distributed as dist

from ..core import collectives as core
from ..core import runtime


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
        host = "127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname())
        with contextlib.closing(socket.socket()) as probe:
            probe.bind((host, 0))
            address = f"tcp://{host}:{probe.getsockname()[1]}"
    address = core.broadcast_object(address, 0, name="ringplug.gloo-address")
    dist.init_process_group(backend, init_method=address, rank=runtime.rank(),
                            world_size=runtime.size())  # fmt: skip
    return True


def destroy_gloo_group() -> None:
    """Stop the group (every rank together: gloo's threads must end before exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
