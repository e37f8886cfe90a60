"""How many threads each rank's libraries start: ``OMP_NUM_THREADS`` when the user gave none.

Unset, every rank sizes its pools by itself, and gets it wrong either way: torch's MKL
builds see the launcher's local-size variable (``MPI_LOCALNRANKS``, Open MPI's
``OMPI_COMM_WORLD_LOCAL_SIZE``) and run one thread, however many cores the rank has; builds
without MKL take every core in every rank. torchrun sets 1; ringrun's wrapper, which sees its
own host's rank count, gives each rank its share of the host (docs/torch.md has the numbers).

Standard library only: the wrapper imports it in every rank's supervisor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ringplug import config, wire

LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE")
"""Where MPICH/hydra (and Intel MPI), Open MPI and PMIx launchers say how many ranks share
this host."""

OMP_VARIABLE = "OMP_NUM_THREADS"


def local_size_from_environment(environ: Mapping[str, str]) -> int | None:
    """How many ranks the launcher started on this host, or ``None`` if it did not say."""
    for name in LOCAL_SIZE_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity: a launcher's binding, a cgroup)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def share_of_cores(cores: int, ranks_on_host: int) -> int:
    """One rank's threads: ``max(1, cores // ranks_on_host)``; ringrun's wrapper and
    ``ringplug.core.threads_per_rank`` (RingStrategy, Fabric, ``ringplug.keras.init``)
    both use this rule, so a value one of them set the other finds unchanged."""
    return max(1, cores // max(1, ranks_on_host))


def splits_threads(environ: Mapping[str, str]) -> bool:
    """Whether ringrun sets ``OMP_NUM_THREADS`` for ranks that have none
    (``RINGPLUG_SPLIT_THREADS``, on by default)."""
    try:
        return bool(config.SPLIT_THREADS.read(environ))
    except ValueError:
        return True  # ringrun refused it before the job (started without ringrun: default)


def thread_variables(environ: Mapping[str, str], cores: int | None = None) -> dict[str, str]:
    """The variables that give a rank its share of its host's cores when the user did not
    say how many threads to use: ``OMP_NUM_THREADS`` and :data:`~ringplug.wire.THREADS_VARIABLE`
    (the same value: ringrun's, not the user's).

    Empty when ``OMP_NUM_THREADS`` is set (the user's, whatever it is), when
    ``RINGPLUG_SPLIT_THREADS=0``, or when the launcher did not say how many ranks share the
    host. Computed per rank from that count, so hosts running different numbers of ranks
    get different shares. `cores` defaults to :func:`usable_cores` (a rank bound to one
    core by ``--bind-to core`` gets 1).
    """
    if environ.get(OMP_VARIABLE) or not splits_threads(environ):
        return {}
    ranks_on_host = local_size_from_environment(environ)
    if ranks_on_host is None:
        return {}
    share = str(share_of_cores(usable_cores() if cores is None else cores, ranks_on_host))
    return {OMP_VARIABLE: share, wire.THREADS_VARIABLE: share}


def threads_note(
    np: int,
    all_local: bool,
    environ: Mapping[str, str],
    rank_env: Mapping[str, str | None],
) -> str | None:
    """What ringrun says, once per job, when its wrapper will set ``OMP_NUM_THREADS`` for
    the ranks (as torchrun says when it sets 1); ``None`` when it will not, or for one rank.

    Args:
        np: how many ranks the job runs.
        all_local: whether they all run on this machine, one host (then the note gives
            the number).
        environ: ringrun's environment, which the ranks inherit.
        rank_env: the variables ``-x`` gives the ranks (``None``: forwarded from `environ`).

    Raises:
        ValueError: ``RINGPLUG_SPLIT_THREADS`` is no switch; the message says what to write.
    """
    given = {name: value for name, value in rank_env.items() if value is not None}
    ranks = {**environ, **given}
    if ranks.get(OMP_VARIABLE) or not config.SPLIT_THREADS.read(ranks) or np < 2:
        return None
    here = ""
    if all_local:
        cores = usable_cores()
        here = f" (here {cores} // {np} = {share_of_cores(cores, np)})"
    return (
        f"{OMP_VARIABLE} is unset: each rank gets its share of its host's cores, cores // "
        f"ranks on that host{here}, so that their threads do not oversubscribe the cores; "
        f"choose another with -x {OMP_VARIABLE}=N, or leave it unset with "
        f"{config.SPLIT_THREADS.name}=0"
    )
