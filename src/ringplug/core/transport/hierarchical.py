"""The hierarchical allreduce of a job on several hosts: within each host, among one rank
per host, within each host again.

1. Each host's ranks reduce onto their leader (the host's lowest rank) through the host's
   own communicator, which MPI runs through shared memory: MPI's Ireduce where MPI can
   reduce the dtype and op, else ringplug's recursive doubling or ring inside the host.
2. The leaders, one per host, allreduce among themselves: the only step that crosses the
   network, with 1/local_size of the flat ring's messages across it. Below the fixed ring
   threshold (`RINGPLUG_RING_THRESHOLD`, 1 MiB unset) MPI's Allreduce (recursive doubling
   where MPI cannot reduce), the ring from there on.
3. Each leader broadcasts the result to its host (MPI's Ibcast).

From the ring threshold on, where every host has as many ranks as the others, every rank
crosses the network instead of its leader alone (the shape of NCCL's and Horovod's
hierarchical allreduce): a ring reduce-scatter within the host leaves each rank one
reduced chunk; the ranks of equal place on their hosts (a "column", one per host)
allreduce that chunk; a ring allgather within the host gives every rank every chunk. The
network then carries 1/local_size of the buffer per rank, in local_size streams at once,
and no leader copies the whole buffer in and out twice.

Every rank gets the leader's bytes, so the result is the same on every rank (the order of
its sums is not the flat algorithms': floats differ from theirs in the last bits).

Hosts are told apart by `host_key`: the MPI processor name (the host name), or for tests
only ``RINGPLUG_TEST_RANKS_PER_HOST=k``, which puts world ranks ``i*k .. i*k+k-1`` on a
pretend host ``i`` so that one machine can run the algorithm's code on several "hosts" (its
timings then mean nothing: every rank shares one memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import config
from ..dtypes import DType
from ..ops import ReduceOp
from . import doubling, ring
from .waiting import Waiter

if TYPE_CHECKING:
    from mpi4py import MPI


def host_key() -> str:
    """The name of this rank's host (see the module's note on the test-only setting)."""
    from mpi4py import MPI

    fake = config.TEST_RANKS_PER_HOST.read()
    if fake:
        return f"test-host-{MPI.COMM_WORLD.Get_rank() // fake}"
    return MPI.Get_processor_name()


def spans_hosts(hosts: Sequence[str]) -> bool:
    """Whether the ranks on `hosts` (each rank's host) gain from the hierarchy: more than
    one host, and more than one rank on some host."""
    return 1 < len(set(hosts)) < len(hosts)


def why_not(hosts: Sequence[str]) -> str:
    """Why `spans_hosts(hosts)` is false, in words."""
    if len(set(hosts)) == 1:
        return f"its {len(hosts)} ranks are all on one host ({hosts[0]})"
    return f"each of its {len(hosts)} ranks is on a host of its own"


@dataclass
class Hierarchy:
    """The two communicators of the hierarchical allreduce, made once per Transport.

    Args:
        host: the ranks of this rank's host, in the parent's order (rank 0: the leader).
        leaders: the leaders of every host, in host order; None on the other ranks.
        column: where every host has as many ranks, the ranks of this rank's place on
            each host, in host order (the leaders' column is `leaders`); else None.
    """

    host: MPI.Comm
    leaders: MPI.Comm | None
    column: MPI.Comm | None = None

    def free(self) -> None:
        self.host.Free()
        if self.column is not None:
            self.column.Free()  # the leaders' column is `leaders`
        elif self.leaders is not None:
            self.leaders.Free()


def split(comm: MPI.Comm, hosts: Sequence[str], waiter: Waiter) -> Hierarchy:
    """The `Hierarchy` of `comm`, whose rank r is on host ``hosts[r]`` (collective).

    MPI has no nonblocking Comm_split, so a barrier under the waiter's deadline comes first:
    a rank that never gets here is named after `RINGPLUG_TIMEOUT`, and the splits start
    only once every rank is at them.
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    waiter.wait_requests([comm.Ibarrier()], "hierarchical allreduce: every rank at the split")
    order = list(dict.fromkeys(hosts))
    host = comm.Split(order.index(hosts[rank]), rank)
    leader = host.Get_rank() == 0
    if len({hosts.count(name) for name in order}) == 1:  # every host as many ranks
        column = comm.Split(host.Get_rank(), rank)
        return Hierarchy(host, column if leader else None, column)
    leaders = comm.Split(0 if leader else MPI.UNDEFINED, rank)
    return Hierarchy(host, leaders if leader else None)


def allreduce(
    hierarchy: Hierarchy,
    flat: np.ndarray,
    op: ReduceOp,
    code: DType,
    mpi_op: Any,
    scratch: np.ndarray,
    ring_threshold: int,
    waiter: Waiter,
) -> None:
    """flat <- the reduction over every rank of the hierarchy's parent, in place, unscaled.

    Args:
        op: the wire op (Sum for Average).
        mpi_op: MPI's op for `flat` (bool viewed as uint8 with MAX/MIN by the caller), or
            None where MPI cannot reduce `code` with `op`.
        scratch: the ring's scratch buffer.
        ring_threshold: from this many bytes the leaders (or columns) take the ring.
    """
    from mpi4py import MPI

    host = hierarchy.host
    local = host.Get_size()
    step = _AllreduceOn(op, code, scratch, ring_threshold, waiter)
    if hierarchy.column is not None and local > 1 and flat.nbytes >= ring_threshold:
        # The large buffers' form (see the module's note).
        bounds = ring.even_bounds(flat.size, local)
        ring.reduce_scatter(host, flat, bounds, op, code, scratch, 0, 1.0, waiter)
        mine = (host.Get_rank() + 1) % local  # the chunk the reduce-scatter left here
        chunk = flat[bounds[mine] : bounds[mine + 1]]
        step(hierarchy.column, chunk, mpi_op, "hierarchical allreduce: along the column")
        ring.allgather_chunks(host, flat, bounds, 0, waiter)
        return
    if local > 1:
        if mpi_op is not None:
            send = MPI.IN_PLACE if host.Get_rank() == 0 else flat
            request = host.Ireduce(send, flat if host.Get_rank() == 0 else None, mpi_op, 0)
            _wait(waiter, request, "Ireduce", "hierarchical allreduce: within the host")
        else:
            step(host, flat, None, "hierarchical allreduce: within the host")
    if hierarchy.leaders is not None:
        step(hierarchy.leaders, flat, mpi_op, "hierarchical allreduce: among the hosts")
    if local > 1:
        request = host.Ibcast(flat.reshape(-1).view(np.uint8), 0)
        _wait(waiter, request, "Ibcast", "hierarchical allreduce: the result to the host")


@dataclass
class _AllreduceOn:
    """An allreduce over one of the hierarchy's communicators, in place: MPI's Iallreduce
    below the ring threshold where MPI can reduce; else ringplug's own, recursive doubling
    below the threshold and the ring from it on."""

    op: ReduceOp
    code: DType
    scratch: np.ndarray
    ring_threshold: int
    waiter: Waiter

    def __call__(self, comm: MPI.Comm, buf: np.ndarray, mpi_op: Any, phase: str) -> None:
        from mpi4py import MPI

        if comm.Get_size() < 2 or not buf.size:
            return
        if buf.nbytes >= self.ring_threshold:
            ring.allreduce(comm, buf, self.op, self.code, self.scratch, 1.0, self.waiter)
        elif mpi_op is None:
            doubling.allreduce(comm, buf, self.op, self.code, self.waiter)
        else:
            _wait(self.waiter, comm.Iallreduce(MPI.IN_PLACE, buf, mpi_op), "Iallreduce", phase)


def _wait(waiter: Waiter, request: MPI.Request, call: str, phase: str) -> None:
    waiter.traffic.called(call)
    waiter.wait_requests([request], phase)
