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

from ...config import Settings
from ..dtypes import DType
from ..ops import ReduceOp
from . import adasum, doubling, reduce, ring
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
        # which path the last allreduce or reducescatter took (tests and benchmarks read it)
        self.last_path = ""
        # The engine gives its own, which also carries notices between the ranks.
        self.waiter = Waiter(None, settings, self.rank, self.size)
        self._mpi_ops: dict[ReduceOp, MPI.Op] = {}
        if comm is not None:
            from mpi4py import MPI

            self._mpi_ops = {
                ReduceOp.AVERAGE: MPI.SUM, ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN,
                ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD,
            }  # fmt: skip

    def free(self) -> None:
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

    def uses_ring(self, nbytes: int, code: DType, op: ReduceOp | None = None) -> bool:
        """Whether an allreduce of `nbytes` takes ringplug's ring (else MPI's Allreduce).

        Max and Min of floating-point values always take the ring: numpy's maximum and
        minimum propagate NaN whichever rank holds it, while MPI's MAX/MIN keep it only
        when the last rank combined holds it.
        """
        if op in (ReduceOp.MAX, ReduceOp.MIN) and code.is_floating:
            return True
        return code not in _MPI_NATIVE or nbytes >= self.settings.ring_threshold

    def uses_doubling(self, buf: np.ndarray | ring.Pieces, code: DType, op: ReduceOp) -> bool:
        """Whether an allreduce of `buf` takes recursive doubling: a small one (below the
        ring's threshold, where MPI's own Allreduce would take it) that MPI cannot reduce
        (16-bit floats, or Max and Min of floats, see `uses_ring`). The ring would pay
        2 (p - 1) steps of latency for it, doubling pays ceil(log2 p) (+2 when p is not a
        power of two)."""
        nbytes = buf.size * code.itemsize
        return (
            isinstance(buf, np.ndarray)
            and nbytes < self.settings.ring_threshold
            and self.uses_ring(nbytes, code, op)
        )

    def _wait(self, request: MPI.Request, phase: str) -> None:
        self.waiter.traffic.called(phase.split()[1])  # "MPI Iallreduce" -> "Iallreduce"
        self.waiter.wait_requests([request], phase)

    def allreduce(
        self, buf: np.ndarray | ring.Pieces, op: ReduceOp, code: DType, postscale: float = 1.0
    ) -> None:
        """buf <- reduction over ranks times `postscale`, in place (Average is summed here:
        pass 1/size as `postscale`).

        `buf` is a flat array, or several (`ring.Pieces`, only for sizes the ring takes).
        """
        if self.size == 1:
            self.last_path = "local"
        elif self.uses_doubling(buf, code, op):
            self.last_path = "doubling"
            doubling.allreduce(self._comm, buf, ring_op(op), code, self.waiter)
        elif self.uses_ring(buf.size * code.itemsize, code, op):
            self.last_path = "ring"
            ring.allreduce(
                self._comm, buf, ring_op(op), code, self._scratch, postscale, self.waiter
            )
            return
        else:
            self.last_path = "mpi"
            self._mpi_allreduce(buf, op, code)
        if postscale != 1.0:
            for array in buf.arrays if isinstance(buf, ring.Pieces) else [buf]:
                reduce.scale(array, postscale, code)

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
            self._wait(self._comm.Ibcast(buf.reshape(-1).view(np.uint8), root), "MPI Ibcast")

    def allgather(self, send: np.ndarray, rows: list[int]) -> np.ndarray:
        """Concatenate every rank's rows; `rows[r]` is rank r's first dimension."""
        out = np.empty((sum(rows), *send.shape[1:]), send.dtype)
        if self.size == 1:
            out[...] = send
            return out
        from mpi4py import MPI

        row_bytes = _row_bytes(send)
        counts = np.asarray(rows, np.int64) * row_bytes
        request = self._comm.Iallgatherv(
            [send.reshape(-1).view(np.uint8), MPI.BYTE],
            [out.reshape(-1).view(np.uint8), (counts, displacements(counts)), MPI.BYTE],
        )
        self._wait(request, "MPI Iallgatherv")
        return out

    def reducescatter(
        self, send: np.ndarray, op: ReduceOp, code: DType, prescale: float
    ) -> np.ndarray:
        """Reduce `send` over ranks and return this rank's block of rows (unscaled result)."""
        rows = ring.even_bounds(send.shape[0], self.size)
        row_elems = send.size // send.shape[0] if send.shape[0] else 0
        work = np.array(send.reshape(-1), copy=True)
        reduce.scale(work, prescale, code)
        if self.size > 1:
            if self.uses_doubling(work, code, op):  # small, and MPI cannot reduce it
                self.last_path = "doubling"
                doubling.allreduce(self._comm, work, ring_op(op), code, self.waiter)
            elif self.uses_ring(send.nbytes, code, op):
                self.last_path = "ring"
                bounds = [b * row_elems for b in rows]
                ring.reduce_scatter(
                    self._comm,
                    work,
                    bounds,
                    ring_op(op),
                    code,
                    self._scratch,
                    1,
                    waiter=self.waiter,
                )
            else:  # small: MPI's Allreduce, then keep this rank's rows
                self.last_path = "mpi"
                self._mpi_allreduce(work, op, code)
        lo, hi = rows[self.rank] * row_elems, rows[self.rank + 1] * row_elems
        return work[lo:hi].reshape((rows[self.rank + 1] - rows[self.rank], *send.shape[1:]))

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
        `postscale`, the rest partial results. Large buffers take the ring on the arrays
        themselves; small ones MPI's Allreduce of a copy (lower latency, and the same sums
        an allreduce of them gives)."""
        if prescale != 1.0:
            for array in arrays:
                reduce.scale(array, prescale, code)
        bounds = [0]
        for count in counts:
            bounds.append(bounds[-1] + count)
        if self.size == 1 or not self.uses_ring(bounds[-1] * code.itemsize, code, op):
            pieces = ring.Pieces(arrays)
            work = np.concatenate(pieces.arrays) if pieces.arrays else np.empty(0, code.storage)
            if self.size > 1:
                self._mpi_allreduce(work, op, code)
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


def _row_bytes(array: np.ndarray) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize


def displacements(counts: np.ndarray) -> np.ndarray:
    """Start offsets of consecutive blocks of the given sizes."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
