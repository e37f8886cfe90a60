"""The data phase of every collective: moving bytes once the ranks have agreed what to move.

Nothing here checks that ranks agree; the engine's negotiation has done that before any
of these run, so every argument is the same on every rank (except the data, and the
per-rank counts of the variable-size collectives, which every rank knows). All buffers are
flat or row-major contiguous numpy arrays in their storage type. Only the engine thread
calls a Transport.

Every MPI call here is the nonblocking form, waited for by the engine's `Waiter`: a peer
that stops answering ends in a message naming it after `RINGPLUG_TIMEOUT`, never a hang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...config import FIXED_RING_THRESHOLD, Settings
from ..algorithms import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    CHAIN,
    DOUBLING,
    HIERARCHICAL,
    REDUCESCATTER,
    RING,
    AlgorithmTable,
    parse_forced,
)
from ..algorithms import (
    MPI as MPI_OWN,
)
from ..dtypes import DType
from ..ops import ReduceOp
from . import adasum, calibration, chain, doubling, hierarchical, reduce, ring
from .waiting import Waiter

if TYPE_CHECKING:
    from mpi4py import MPI

# Types MPI reduces natively (bool as uint8 max/min); 16-bit floats always take the ring.
_MPI_NATIVE = {DType.FLOAT32, DType.FLOAT64, DType.INT8, DType.INT16, DType.INT32,
               DType.INT64, DType.UINT8, DType.BOOL}  # fmt: skip


def ring_op(op: ReduceOp) -> ReduceOp:
    """The op the wire reduction uses: Average is a Sum followed by a division."""
    return ReduceOp.SUM if op is ReduceOp.AVERAGE else op


class Transport:
    """Data movement among the ranks of one MPI communicator (or a world of one)."""

    def __init__(self, comm: MPI.Comm | None, settings: Settings) -> None:
        self.settings = settings
        self._comm = comm.Dup() if comm is not None else None
        self.rank = self._comm.Get_rank() if self._comm is not None else 0
        self.size = self._comm.Get_size() if self._comm is not None else 1
        self._scratch = np.empty(settings.ring_segment, np.uint8)
        # which algorithm the last allreduce, reducescatter, allgather or broadcast took
        # (tests and benchmarks read it)
        self.last_path = ""
        # The engine gives its own, which also carries notices between the ranks.
        self.waiter = Waiter(None, settings, self.rank, self.size)
        # RINGPLUG_ALGORITHM, refused here (at init, on every rank alike) when it names
        # no kind or algorithm.
        self.forced = parse_forced(settings.algorithm)
        self._algorithms: AlgorithmTable | None = None  # made at the first choice
        self._hosts: list[str] | None = None  # each rank's host, asked at the first choice
        # the host's and the leaders' communicators, made at the first hierarchical call
        self._hierarchy: hierarchical.Hierarchy | None = None
        self._mpi_ops: dict[ReduceOp, MPI.Op] = {}
        if comm is not None:
            from mpi4py import MPI

            self._mpi_ops = {
                ReduceOp.AVERAGE: MPI.SUM, ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN,
                ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD,
            }  # fmt: skip

    def free(self) -> None:
        if self._hierarchy is not None:
            self._hierarchy.free()
            self._hierarchy = None
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def renew(self, parent: MPI.Comm) -> None:
        """Replace the communicator after a collective was abandoned (a peer failed it).

        Its operations can never complete and would match later messages (a ring send
        left posted), so every rank leaves it behind, in the same engine cycle, for a
        duplicate of `parent` (the engine's own communicator: no other thread uses it).
        """
        if self._comm is None:
            return
        self.waiter.what = "renewing the data communicator after a failed collective"
        fresh, request = parent.Idup()
        self.waiter.wait_requests([request])
        stale, self._comm = self._comm, fresh
        stale.Free()  # its pending operations stay posted, harmlessly, on a freed context
        if self._hierarchy is not None:  # split again from the fresh one at the next use
            self._hierarchy.free()
            self._hierarchy = None

    def mpi_reduces(self, code: DType, op: ReduceOp | None) -> bool:
        """Whether MPI's own reductions can reduce `code` with `op`.

        Not 16-bit floats, and not Max and Min of floating-point values: numpy's maximum and
        minimum propagate NaN whichever rank holds it, while MPI's MAX/MIN keep it only
        when the last rank combined holds it.
        """
        if op in (ReduceOp.MAX, ReduceOp.MIN) and code.is_floating:
            return False
        return code in _MPI_NATIVE

    @property
    def algorithms(self) -> AlgorithmTable:
        """This communicator's algorithm table (`core.algorithms`), made at its first use.

        Making it is collective (rank 0 loads or measures it and sends it to every rank):
        every rank of the communicator gets here at the same collective, the first one of
        more than one rank that chooses an algorithm, as the engine's agreed plan runs them
        in one order everywhere.
        """
        if self._algorithms is None:
            self._algorithms = calibration.agreed_table(self)
        return self._algorithms

    def hosts(self) -> list[str]:
        """Each rank's host (`hierarchical.host_key`), in rank order (collective the first
        time: every rank asks at the same collective, the first that chooses)."""
        if self._hosts is None:
            self._hosts = self.allgather_texts(hierarchical.host_key())
        return self._hosts

    def spans_hosts(self) -> bool:
        """Whether the hierarchical allreduce is a candidate here (collective the first time,
        see `hosts`)."""
        return hierarchical.spans_hosts(self.hosts())

    def use_algorithms(self, table: AlgorithmTable) -> None:
        """Use `table` from now on (the same on every rank: tests and the bench)."""
        self._algorithms = table

    def choose(
        self, kind: str, nbytes: int, code: DType | None = None, op: ReduceOp | None = None
    ) -> str:
        """The algorithm of a `kind` collective of `nbytes` bytes (see `core.algorithms`)."""
        if self.size == 1:
            return "local"
        reduces = code is None or self.mpi_reduces(code, op)
        return self.algorithms.choose(kind, nbytes, reduces)

    def _wait(self, request: MPI.Request, phase: str) -> None:
        self.waiter.traffic.called(phase.split()[1])  # "MPI Iallreduce" -> "Iallreduce"
        self.waiter.wait_requests([request], phase)

    def allreduce(
        self, buf: np.ndarray | ring.Pieces, op: ReduceOp, code: DType, postscale: float = 1.0
    ) -> None:
        """buf <- reduction over ranks times `postscale`, in place (Average is summed here:
        pass 1/size as `postscale`).

        `buf` is a flat array, or several (`ring.Pieces`, only where the table chooses the
        ring: the kinds ask `choose` first).
        """
        algorithm = self.choose(ALLREDUCE, buf.size * code.itemsize, code, op)
        if isinstance(buf, ring.Pieces):
            algorithm = RING  # only the ring reduces several arrays as one
        self.last_path = algorithm
        if algorithm == RING:
            ring.allreduce(
                self._comm, buf, ring_op(op), code, self._scratch, postscale, self.waiter
            )
            return
        assert isinstance(buf, np.ndarray)
        self.allreduce_by(algorithm, buf, op, code)
        if postscale != 1.0:
            reduce.scale(buf, postscale, code)

    def allreduce_by(self, algorithm: str, flat: np.ndarray, op: ReduceOp, code: DType) -> None:
        """flat <- the reduction over ranks by `algorithm` (``"mpi"``, ``"doubling"``,
        ``"ring"``, ``"hierarchical"``; ``"local"`` on one rank), unscaled."""
        if algorithm == HIERARCHICAL:
            self._hierarchical_allreduce(flat, op, code)
        elif algorithm == DOUBLING:
            doubling.allreduce(self._comm, flat, ring_op(op), code, self.waiter)
        elif algorithm == RING:
            ring.allreduce(self._comm, flat, ring_op(op), code, self._scratch, 1.0, self.waiter)
        elif algorithm == MPI_OWN:
            self._mpi_allreduce(flat, op, code)
        elif algorithm != "local":
            raise ValueError(f"allreduce has no algorithm {algorithm!r}")

    def _hierarchical_allreduce(self, flat: np.ndarray, op: ReduceOp, code: DType) -> None:
        from mpi4py import MPI

        if self._hierarchy is None:
            if not self.spans_hosts():
                raise ValueError(
                    f"the hierarchical allreduce needs ranks on several hosts: "
                    f"{hierarchical.why_not(self.hosts())}"
                )
            self._hierarchy = hierarchical.split(self._comm, self.hosts(), self.waiter)
        mpi_op = None
        if self.mpi_reduces(code, op):
            if code is DType.BOOL:
                mpi_op = MPI.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else MPI.MIN
                flat = flat.view(np.uint8)
            else:
                mpi_op = self._mpi_ops[op]
        threshold = self.settings.ring_threshold
        hierarchical.allreduce(
            self._hierarchy,
            flat,
            ring_op(op),
            code,
            mpi_op,
            self._scratch,
            FIXED_RING_THRESHOLD if threshold is None else threshold,
            self.waiter,
        )

    def _mpi_allreduce(self, flat: np.ndarray, op: ReduceOp, code: DType) -> None:
        from mpi4py import MPI

        if code is DType.BOOL:
            mpi_op = MPI.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else MPI.MIN
            flat = flat.view(np.uint8)
        else:
            mpi_op = self._mpi_ops[op]
        self._wait(self._comm.Iallreduce(MPI.IN_PLACE, flat, mpi_op), "MPI Iallreduce")

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """buf <- root's buf, in place."""
        if self.size > 1 and buf.nbytes:
            self.last_path = self.choose(BROADCAST, buf.nbytes)
            self.broadcast_by(self.last_path, buf, root)

    def broadcast_by(self, algorithm: str, buf: np.ndarray, root: int) -> None:
        """buf <- root's buf by `algorithm` (``"mpi"`` or ``"chain"``)."""
        data = buf.reshape(-1).view(np.uint8)
        if algorithm == CHAIN:
            chain.broadcast(self._comm, data, root, self.settings.ring_segment, self.waiter)
        else:
            self._wait(self._comm.Ibcast(data, root), "MPI Ibcast")

    def allgather(self, send: np.ndarray, rows: list[int]) -> np.ndarray:
        """Concatenate every rank's rows; `rows[r]` is rank r's first dimension."""
        out = np.empty((sum(rows), *send.shape[1:]), send.dtype)
        if self.size == 1:
            out[...] = send
            return out
        self.last_path = self.choose(ALLGATHER, out.nbytes)
        self.allgather_by(self.last_path, send, rows, out)
        return out

    def allgather_by(
        self, algorithm: str, send: np.ndarray, rows: list[int], out: np.ndarray
    ) -> None:
        """out <- every rank's rows of `send`, by `algorithm` (``"mpi"`` or ``"ring"``)."""
        from mpi4py import MPI

        counts = np.asarray(rows, np.int64) * _row_bytes(send)
        starts = displacements(counts)
        flat = out.reshape(-1).view(np.uint8)
        if algorithm == RING:
            mine = int(starts[self.rank])
            flat[mine : mine + int(counts[self.rank])] = send.reshape(-1).view(np.uint8)
            bounds = [*(int(start) for start in starts), int(counts.sum())]
            ring.allgather_chunks(self._comm, flat, bounds, 1, self.waiter)
            return
        request = self._comm.Iallgatherv(
            [send.reshape(-1).view(np.uint8), MPI.BYTE], [flat, (counts, starts), MPI.BYTE]
        )
        self._wait(request, "MPI Iallgatherv")

    def reducescatter(
        self, send: np.ndarray, op: ReduceOp, code: DType, prescale: float
    ) -> np.ndarray:
        """Reduce `send` over ranks and return this rank's block of rows (unscaled result)."""
        rows = ring.even_bounds(send.shape[0], self.size)
        row_elems = send.size // send.shape[0] if send.shape[0] else 0
        work = np.array(send.reshape(-1), copy=True)
        reduce.scale(work, prescale, code)
        if self.size > 1:
            algorithm = self.choose(REDUCESCATTER, send.nbytes, code, op)
            self.last_path = algorithm
            self.reducescatter_by(algorithm, work, [b * row_elems for b in rows], op, code)
        lo, hi = rows[self.rank] * row_elems, rows[self.rank + 1] * row_elems
        return work[lo:hi].reshape((rows[self.rank + 1] - rows[self.rank], *send.shape[1:]))

    def reducescatter_by(
        self, algorithm: str, work: np.ndarray, bounds: list[int], op: ReduceOp, code: DType
    ) -> None:
        """Afterwards work[bounds[rank]:bounds[rank + 1]] holds the reduction over ranks:
        by the ring's reduce-scatter (``"ring"``), or by an allreduce of all of `work`
        (``"mpi"``, ``"doubling"``), each rank keeping its block."""
        if algorithm == RING:
            ring.reduce_scatter(
                self._comm, work, bounds, ring_op(op), code, self._scratch, 1, waiter=self.waiter
            )
        else:
            self.allreduce_by(algorithm, work, op, code)

    def adasum(self, buf: np.ndarray, bounds: list[int]) -> None:
        """buf <- the Adasum of every rank's buf, tensor by tensor (tensor i in
        [bounds[i], bounds[i + 1])), in place; see `adasum`."""
        self.last_path = "adasum"
        adasum.allreduce(self._comm, buf, bounds, self.waiter)

    def allgather_in_place(self, arrays: list[np.ndarray], counts: list[int]) -> None:
        """Every rank's block of the concatenation of `arrays` (`counts[r]` elements for
        rank r, in rank order) to every rank, in place, by the ring."""
        if self.size == 1:
            return
        bounds = [0]
        for count in counts:
            bounds.append(bounds[-1] + count)
        ring.allgather_chunks(self._comm, ring.Pieces(arrays), bounds, 1, self.waiter)

    def reducescatter_in_place(
        self,
        arrays: list[np.ndarray],
        counts: list[int],
        op: ReduceOp,
        code: DType,
        prescale: float,
        postscale: float,
    ) -> None:
        """Reduce the concatenation of `arrays` over ranks in place; afterwards this rank's
        block (`counts[r]` elements for rank r, in rank order) holds the reduction times
        `postscale`, the rest partial results. Where the table chooses the ring, it runs on
        the arrays themselves; otherwise an allreduce of a copy (lower latency for small
        buffers, and the same sums an allreduce of them gives)."""
        if prescale != 1.0:
            for array in arrays:
                reduce.scale(array, prescale, code)
        bounds = [0]
        for count in counts:
            bounds.append(bounds[-1] + count)
        algorithm = self.choose(REDUCESCATTER, bounds[-1] * code.itemsize, code, op)
        if algorithm != RING:
            pieces = ring.Pieces(arrays)
            work = np.concatenate(pieces.arrays) if pieces.arrays else np.empty(0, code.storage)
            self.allreduce_by(algorithm, work, op, code)
            lo, hi = bounds[self.rank], bounds[self.rank + 1]
            if postscale != 1.0:
                reduce.scale(work[lo:hi], postscale, code)
            offset = lo
            for part in pieces.views(lo, hi):
                part[...] = work[offset : offset + part.size]
                offset += part.size
            return
        ring.reduce_scatter(
            self._comm,
            ring.Pieces(arrays),
            bounds,
            ring_op(op),
            code,
            self._scratch,
            1,
            postscale,
            self.waiter,
        )

    def alltoall(self, send: np.ndarray, send_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows send_rows[i] of `send` go to rank i; returns what arrived and from whom."""
        if self.size == 1:
            return send.copy(), send_rows.copy()
        from mpi4py import MPI

        recv_rows = np.empty(self.size, np.int64)
        self._wait(self._comm.Ialltoall(send_rows, recv_rows), "MPI Ialltoall of the row counts")
        row_bytes = _row_bytes(send)
        out = np.empty((int(recv_rows.sum()), *send.shape[1:]), send.dtype)
        send_counts, recv_counts = send_rows * row_bytes, recv_rows * row_bytes
        request = self._comm.Ialltoallv(
            [send.reshape(-1).view(np.uint8), (send_counts, displacements(send_counts)), MPI.BYTE],
            [out.reshape(-1).view(np.uint8), (recv_counts, displacements(recv_counts)), MPI.BYTE],
        )
        self._wait(request, "MPI Ialltoallv")
        return out, recv_rows

    def broadcast_bytes(self, data: bytes, length: int, root: int) -> bytes:
        """Root's `data` (of `length` bytes, known everywhere) on every rank."""
        if self.size == 1 or length == 0:
            return data if self.rank == root else b""
        # mpi4py needs a writable buffer for Bcast, on the root too.
        buffer = bytearray(data) if self.rank == root else bytearray(length)
        self._wait(self._comm.Ibcast([buffer, len(buffer)], root), "MPI Ibcast")
        return bytes(buffer)

    def allgather_bytes(self, data: bytes, lengths: list[int]) -> list[bytes]:
        """Every rank's bytes; `lengths[r]` is the length of rank r's."""
        if self.size == 1:
            return [data]
        from mpi4py import MPI

        counts = np.asarray(lengths, np.int64)
        buffer = np.empty(int(counts.sum()), np.uint8)
        displs = displacements(counts)
        request = self._comm.Iallgatherv(
            [np.frombuffer(data, np.uint8), MPI.BYTE], [buffer, (counts, displs), MPI.BYTE]
        )
        self._wait(request, "MPI Iallgatherv")
        return [buffer[d : d + n].tobytes() for d, n in zip(displs, counts, strict=True)]

    def barrier(self) -> None:
        """Wait until every rank got here."""
        if self.size > 1:
            self._wait(self._comm.Ibarrier(), "MPI Ibarrier")

    def allgather_texts(self, text: str) -> list[str]:
        """Every rank's `text`, in rank order."""
        if self.size == 1:
            return [text]
        data = text.encode()
        lengths = np.empty(self.size, np.int64)
        mine = np.array([len(data)], np.int64)
        self._wait(self._comm.Iallgather(mine, lengths), "MPI Iallgather of the lengths")
        return [part.decode() for part in self.allgather_bytes(data, [int(n) for n in lengths])]

    def broadcast_text(self, text: str, root: int) -> str:
        """Root's `text` on every rank."""
        if self.size == 1:
            return text
        length = np.array([len(text.encode()) if self.rank == root else 0], np.int64)
        self._wait(self._comm.Ibcast(length, root), "MPI Ibcast of the length")
        return self.broadcast_bytes(text.encode(), int(length[0]), root).decode()


def _row_bytes(array: np.ndarray) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize


def displacements(counts: np.ndarray) -> np.ndarray:
    """Start offsets of consecutive blocks of the given sizes."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
