"""The GPU a rank's torch work goes to by default: the one of its local rank.

With several ranks on a host, every rank would otherwise compute on ``cuda:0`` (torch's
current device until someone changes it), and NCCL refuses two ranks on one GPU. As
torchrun users write ``torch.cuda.set_device(local_rank)`` and Horovod users
``torch.cuda.set_device(hvd.local_rank())`` by hand, `ringplug.torch.init()` and the
``ringplug`` torch.distributed backend do it for them.
"""

from __future__ import annotations

import logging

import torch

from ..core import runtime

logger = logging.getLogger(__name__)
_queued: list[int] = []  # the index queued with torch's lazy CUDA initialisation, if any


def local_gpu_index(local_rank: int, visible: int) -> int | None:
    """The GPU (among the visible ones) local rank `local_rank` uses, or None when it has
    none of its own: one rank per GPU, and the only GPU where each rank sees one (the
    launcher or scheduler set CUDA_VISIBLE_DEVICES per rank)."""
    if visible < 1:
        return None
    if visible == 1:
        return 0
    return local_rank if local_rank < visible else None


def use_local_gpu() -> int | None:
    """Make ``cuda:LOCAL_RANK`` torch's current device in this thread, unless the user
    chose already (or CUDA is in use), or this process sees no GPU for this rank.

    The choice is queued with torch's own lazy CUDA initialisation, so a job that never
    touches CUDA (CPU training on a GPU host) does not create a CUDA context on every rank,
    and a later ``torch.cuda.set_device(...)`` of the user's still wins. Returns the index
    chosen, or None. Needs `ringplug.init()` first.
    """
    if not torch.cuda.is_available():
        return None
    if torch.cuda.is_initialized():
        logger.debug(
            "CUDA already in use; leaving torch's current device (%d) as it is.",
            torch.cuda.current_device(),
        )
        return None
    local_rank = runtime.local_rank()
    index = local_gpu_index(local_rank, torch.cuda.device_count())
    if index is None:
        # CPU work stays possible; a GPU collective will say what is wrong.
        logger.info(
            "Local rank %d has no GPU of its own (%d visible); torch's current "
            "device is left as it is.",
            local_rank,
            torch.cuda.device_count(),
        )
        return None
    if _queued != [index]:  # once, however often init() and new groups call this
        _queued[:] = [index]
        torch.cuda._lazy_call(lambda: torch.cuda.set_device(_queued[0]))
    return index


def init() -> None:
    """Join the job (`ringplug.init`) and make this rank's GPU, ``cuda:LOCAL_RANK``, torch's
    current device (unless CUDA is already in use: then the user's choice stands).

    After it, ``model.cuda()`` and ``torch.device("cuda")`` mean this rank's own GPU.
    Idempotent.

    Example:
        >>> import ringplug.torch as rpt  # doctest: +SKIP
        >>> rpt.init()
        >>> model = build_model().cuda()   # on cuda:LOCAL_RANK
    """
    runtime.init()
    use_local_gpu()
