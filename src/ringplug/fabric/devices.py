"""The devices each rank of a launched job trains on, and the ``devices`` that contradict it.

Under ringrun / mpiexec / srun the launcher decides how many ranks there are. Lightning's
``devices="auto"`` means every GPU of the host, whatever the launcher started; RingStrategy
reads it as "the GPUs of this host, one per local rank": local rank i trains on
``cuda:i``, so ``ringrun -np 8 -H a:4,b:4`` on 4-GPU hosts needs no ``devices`` at all.
A ``devices`` that names other GPUs is the user's choice, and is checked against the
launcher's world as DDP would check it (devices per node x ``num_nodes`` ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_DEFAULTS_HINT = "Leave devices and num_nodes at their defaults under ringrun/mpiexec"


def launched_devices(
    devices: Sequence[torch.device],
    *,
    visible_gpus: int,
    local_rank: int,
    local_size: int,
    world_size: int,
    num_nodes: int,
    owner: str = "Trainer",
) -> list[torch.device]:
    """The devices of this host's ranks under an MPI launcher, indexed by local rank.

    Args:
        devices: the Trainer's parallel devices for this host.
        visible_gpus: how many GPUs this process sees (``torch.cuda.device_count()``).
        local_rank: this rank's place among the ranks of its host.
        local_size: how many ranks the launcher started on this host.
        world_size: how many ranks the launcher started in all.
        num_nodes: the Trainer's ``num_nodes``.
        owner: what the user configures ("Trainer", "Fabric"), named in the errors.

    Returns:
        `devices`, shortened to this host's ranks when they were every visible GPU.

    Raises:
        ValueError: `devices` or `num_nodes` contradict the launcher's world, or this rank
            has no GPU of its own; the message says what to change.
    """
    devices = list(devices)
    if _every_visible_gpu(devices, visible_gpus):
        return _one_gpu_per_local_rank(
            devices, local_rank, local_size, world_size, num_nodes, owner
        )
    requested = len(devices)
    if requested > 1 and requested * num_nodes != world_size:
        raise ValueError(
            f"{owner}(devices={requested}, num_nodes={num_nodes}) asks for "
            f"{requested * num_nodes} ranks, but the MPI launcher started {world_size}. "
            f"{_DEFAULTS_HINT}, or start devices x num_nodes ranks."
        )
    cuda = bool(devices) and devices[0].type == "cuda"
    if cuda and requested == 1 and local_size > 1 and visible_gpus > 1:
        raise ValueError(
            f"The {owner}'s devices name one GPU ({devices[0]}) for the {local_size} ranks "
            f"the launcher started on this host, and NCCL needs a GPU per rank. "
            f"{_DEFAULTS_HINT} (each rank then trains on cuda:LOCAL_RANK), or pass "
            f"devices={local_size}."
        )
    if cuda and requested > 1 and local_rank >= requested:  # CPUs: any rank may run
        raise ValueError(
            f"{owner}(devices={requested}) names {requested} devices on this host, but the "
            f"launcher started {local_size} ranks here (this one is local rank {local_rank}). "
            f"{_DEFAULTS_HINT}, or start {requested} ranks on each host."
        )
    return devices


def _every_visible_gpu(devices: list[torch.device], visible_gpus: int) -> bool:
    """Whether `devices` are all the GPUs this process sees, in order: what ``"auto"``
    (or ``-1``, or their count) gives."""
    if visible_gpus < 1 or any(device.type != "cuda" for device in devices):
        return False
    return [device.index or 0 for device in devices] == list(range(visible_gpus))


def _one_gpu_per_local_rank(
    devices: list[torch.device],
    local_rank: int,
    local_size: int,
    world_size: int,
    num_nodes: int,
    owner: str,
) -> list[torch.device]:
    if num_nodes != 1 and num_nodes * local_size != world_size:
        raise ValueError(
            f"{owner}(num_nodes={num_nodes}) with {local_size} ranks on this host asks for "
            f"{num_nodes * local_size} ranks, but the MPI launcher started {world_size}. "
            f"{_DEFAULTS_HINT}, or start the same number of ranks on each of {num_nodes} "
            "hosts."
        )
    if len(devices) == 1:
        # One GPU visible: the launcher or scheduler gave each rank its own
        # (CUDA_VISIBLE_DEVICES per rank), or the host has one.
        return devices
    if local_rank >= len(devices):
        raise ValueError(
            f"Local rank {local_rank} has no GPU of its own: this host shows {len(devices)} "
            f"GPUs, and the launcher started {local_size} ranks on it (NCCL cannot put two "
            f"ranks on one GPU). Start at most {len(devices)} ranks per host "
            f"(ringrun -H host:{len(devices)},...), or train on CPUs (accelerator='cpu')."
        )
    return devices[:local_size]
