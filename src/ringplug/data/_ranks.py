"""The ranks a sampler shards for: those it was given, ringplug's world, or one process."""

from __future__ import annotations

from .. import core


def resolve(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``: as given; else the job's world (ringplug is started at this
    first use when a launcher started the process); else a single process."""
    if num_replicas is not None:
        return num_replicas, rank if rank is not None else 0
    if not core.is_initialized() and core.runtime.launcher_world_size() is not None:
        core.init()  # under a launcher: the world is the job's
    if core.is_initialized():
        return core.size(), core.rank() if rank is None else rank
    return 1, 0
