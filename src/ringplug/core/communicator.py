"""Collectives over one MPI communicator, on flat numpy buffers.

Every collective starts with the same step: each rank sends every other rank a small
header saying what it is about to do (kind, op, dtype, shape, root, sequence number),
and small allreduce/broadcast payloads ride along in the same message. From the headers
every rank reaches the same verdict at the same time: go ahead, or raise the same
mismatch error everywhere. The wait for headers is where a job stalls when a rank is
missing, so it polls with back-off (no spinning core), knows exactly which ranks have not
arrived, and aborts the job with their names after `RINGPLUG_TIMEOUT` seconds.

The data phase then picks, from agreed values only (so every rank picks the same):
local reduction of the eager payloads, MPI's own collective, or ringplug's ring.
"""

from __future__ import annotations

import enum
import logging
import pickle
import struct
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from . import log, reduce, ring
from .config import Settings
from .dtypes import DType
from .errors import MismatchError, PeerArgumentError
from .ops import ReduceOp

if TYPE_CHECKING:
    from mpi4py import MPI

logger = logging.getLogger(__name__)

HEADER_SLOTS = 16
HEADER_BYTES = HEADER_SLOTS * 8
_HEADER = struct.Struct(f"<{HEADER_SLOTS}q")
TRAILING_SLOTS = 6  # dims after the first; more are folded into the last slot
_MAGIC = 0x52494E47  # "RING"
_HEADER_TAG = 7000
# The wait for headers spins this long before it starts sleeping.
_SPIN_SECONDS = 200e-6
_FIRST_SLEEP_SECONDS = 50e-6
_MAX_SLEEP_SECONDS = 1e-3
# Eager payload space per peer is capped so that large worlds don't pin much memory.
_EAGER_TOTAL_BYTES = 8 << 20

# Header layout. Everything up to H_DIM0 must match for every collective; H_DIM0 and
# H_NBYTES must match too unless the collective lets the first dimension differ.
(H_MAGIC, H_SEQ, H_KIND, H_ERROR, H_OP, H_DTYPE, H_ROOT, H_NDIM) = range(8)
H_TRAILING = 8
H_DIM0 = H_TRAILING + TRAILING_SLOTS  # 14
H_NBYTES = H_DIM0 + 1  # 15
_PREFIX_ALL = HEADER_BYTES
_NO_TRAILING = (0,) * TRAILING_SLOTS
_PREFIX_FIRST_DIM_FREE = H_DIM0 * 8


class Kind(enum.IntEnum):
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    REDUCESCATTER = 4
    ALLTOALL = 5
    BARRIER = 6
    BROADCAST_OBJECT = 7
    ALLGATHER_OBJECT = 8

    @property
    def label(self) -> str:
        return self.name.lower()


# What must be equal on every rank, per collective. "trailing": all dims but the first.
_MATCH: dict[Kind, tuple[str, ...]] = {
    Kind.ALLREDUCE: ("op", "dtype", "shape"),
    Kind.ALLGATHER: ("dtype", "trailing"),
    Kind.BROADCAST: ("root", "dtype", "shape"),
    Kind.REDUCESCATTER: ("op", "dtype", "shape"),
    Kind.ALLTOALL: ("dtype", "trailing"),
    Kind.BARRIER: (),
    Kind.BROADCAST_OBJECT: ("root",),
    Kind.ALLGATHER_OBJECT: (),
}

_FIRST_DIM_FREE = {
    Kind.ALLGATHER,
    Kind.ALLTOALL,
    Kind.BARRIER,
    Kind.BROADCAST_OBJECT,
    Kind.ALLGATHER_OBJECT,
}

_MPI_NATIVE = {
    DType.FLOAT32,
    DType.FLOAT64,
    DType.INT8,
    DType.INT16,
    DType.INT32,
    DType.INT64,
    DType.UINT8,
    DType.BOOL,
}


class Communicator:
    """A group of ranks and the collectives among them.

    Built by `ringplug.init()` from MPI's world (or from nothing, as a world of one when
    there is no MPI). Not thread-safe: one thread at a time calls it (the engine thread,
    once there is one).
    """

    def __init__(self, comm: MPI.Comm | None, settings: Settings) -> None:
        self.settings = settings
        if comm is None:
            self.rank, self.size = 0, 1
            self._data = self._ctrl = None
        else:
            # Own communicators, so that user code on COMM_WORLD can never match our messages.
            self._data = comm.Dup()
            self._ctrl = comm.Dup()
            self.rank, self.size = self._data.Get_rank(), self._data.Get_size()
        self._seq = 0
        self.eager_bytes = min(settings.eager_threshold, _EAGER_TOTAL_BYTES // self.size)
        self.eager_bytes -= self.eager_bytes % 8
        # Row r holds rank r's last message (own row: what this rank sends).
        self._messages = np.zeros((self.size, HEADER_BYTES + self.eager_bytes), np.uint8)
        self._headers = self._messages[:, :HEADER_BYTES].view(np.int64)
        self._rows = [memoryview(row) for row in self._messages]
        self._own = self._rows[self.rank]
        self._peers = [(self.rank + d) % self.size for d in range(1, self.size)]
        self._row_views: dict[tuple[DType, int], list[np.ndarray]] = {}
        self._mpi: Any = None
        if comm is not None:
            from mpi4py import MPI

            self._mpi = MPI
            self._landing = [(peer, self._rows[peer]) for peer in self._peers]
        self._scratch = np.empty(settings.ring_segment, np.uint8)
        self.last_path = ""  # which data path the last allreduce took (for tests and benches)

    # ------------------------------------------------------------------ lifecycle
    def free(self) -> None:
        """Release the MPI communicators (idempotent)."""
        for comm in (self._data, self._ctrl):
            if comm is not None:
                comm.Free()
        self._data = self._ctrl = None

    # ------------------------------------------------------------------ agreement
    def _agree(
        self,
        kind: Kind,
        name: str | None,
        *,
        op: int = -1,
        code: int = -1,
        root: int = -1,
        shape: Sequence[int] = (),
        nbytes: int = 0,
        payload: np.ndarray | None = None,
        error: BaseException | None = None,
    ) -> np.ndarray:
        """Exchange headers (and eager payloads); return the (size, 16) header table.

        Raises the same error on every rank when the ranks disagree or one of them
        rejected its arguments; the rank that rejected them re-raises its own error.
        """
        self._seq += 1
        ndim = len(shape)
        if ndim == 1:
            dim0, trailing = shape[0], _NO_TRAILING
        elif ndim == 0:
            dim0, trailing = 0, _NO_TRAILING
        else:
            dim0, trailing = shape[0], tuple(shape[1:])
            if len(trailing) > TRAILING_SLOTS:
                last = int(np.prod(trailing[TRAILING_SLOTS - 1 :], dtype=np.int64))
                trailing = (*trailing[: TRAILING_SLOTS - 1], last)
            trailing += (0,) * (TRAILING_SLOTS - len(trailing))
        _HEADER.pack_into(
            self._own,
            0,
            _MAGIC,
            self._seq,
            kind,
            error is not None,
            op,
            code,
            root,
            ndim,
            *trailing,
            dim0,
            nbytes,
        )
        length = HEADER_BYTES
        if payload is not None and error is None and payload.nbytes:
            length += payload.nbytes
            self._own[HEADER_BYTES:length] = _byte_view(payload)
        if self.size > 1:
            self._exchange(length, kind, name)
        self._check(kind, name, error)
        return self._headers

    def reject(self, kind: Kind, name: str | None, error: BaseException) -> None:
        """Take part in a collective whose arguments were bad on this rank: every rank raises
        (this one its own `error`) instead of the others waiting forever."""
        self._agree(kind, name, error=error)

    def _exchange(self, length: int, kind: Kind, name: str | None) -> None:
        mpi, ctrl = self._mpi, self._ctrl
        outgoing = self._own[:length]
        receives = [ctrl.Irecv(target, peer, _HEADER_TAG) for peer, target in self._landing]
        requests = receives + [ctrl.Isend(outgoing, peer, _HEADER_TAG) for peer in self._peers]
        testall = mpi.Request.Testall
        if testall(requests):
            return
        start = time.perf_counter()
        spin_until = start + _SPIN_SECONDS
        while time.perf_counter() < spin_until:
            if testall(requests):
                return
        # MPI makes progress only inside its calls, so keep testing, but sleep in between:
        # a rank waiting for a slow peer must not take a core from training.
        deadline = start + self.settings.timeout
        delay = _FIRST_SLEEP_SECONDS
        while not testall(requests):
            now = time.perf_counter()
            if now > deadline:
                missing = [
                    peer for peer, req in zip(self._peers, receives, strict=True) if not req.Test()
                ]
                self._abort(kind, name, missing, now - start)
            time.sleep(delay)
            delay = min(delay * 2, _MAX_SLEEP_SECONDS)

    def _abort(self, kind: Kind, name: str | None, missing: list[int], waited: float) -> NoReturn:
        message = (
            f"rank {self.rank} waited {waited:.0f} s in {_what(kind, name, self._seq)} for "
            f"rank(s) {', '.join(map(str, sorted(missing)))}, which never called it "
            f"(RINGPLUG_TIMEOUT={self.settings.timeout:g}). Ending the job: MPI cannot "
            "cancel a collective. Look at what the missing ranks were doing (a stuck data "
            "loader, an uneven number of batches, a branch only some ranks take)."
        )
        log.end_job(self.rank, message)

    def _check(self, kind: Kind, name: str | None, error: BaseException | None) -> None:
        if self.size > 1:
            prefix = _PREFIX_FIRST_DIM_FREE if kind in _FIRST_DIM_FREE else _PREFIX_ALL
            own, rows = self._own[:prefix].tobytes(), self._rows
            for peer in self._peers:
                if rows[peer][:prefix].tobytes() != own:
                    self._explain(kind, name, error)
        if error is not None:
            raise error

    def _explain(self, kind: Kind, name: str | None, error: BaseException | None) -> None:
        """Raise the error that says why the headers differ (the slow path)."""
        headers = self._headers
        if error is not None:
            raise error
        flagged = np.flatnonzero(headers[:, H_ERROR])
        if flagged.size:
            ranks = ", ".join(map(str, flagged))
            raise PeerArgumentError(
                f"{_what(kind, name, self._seq)}: rank(s) {ranks} rejected their arguments "
                f"(their own error says why); no rank ran it."
            )
        raise MismatchError(_mismatch_message(kind, name, self._seq, headers))

    # ------------------------------------------------------------------ collectives
    def allreduce(
        self,
        send: np.ndarray,
        out: np.ndarray,
        op: ReduceOp,
        code: DType,
        prescale: float = 1.0,
        postscale: float = 1.0,
        name: str | None = None,
    ) -> None:
        """out <- reduction of every rank's `send` (contiguous, storage type; may be `out`)."""
        simple = op is not ReduceOp.AVERAGE and prescale == 1.0 and postscale == 1.0
        error = None if simple else _capture(reduce.check_op, op, code, prescale, postscale)
        eager = send.nbytes <= self.eager_bytes
        self._agree(
            Kind.ALLREDUCE,
            name,
            op=op,
            code=code,
            shape=send.shape,
            nbytes=send.nbytes,
            payload=send if eager else None,
            error=error,
        )
        if op is ReduceOp.AVERAGE:
            postscale = postscale / self.size
        flat = out.reshape(-1)
        if self.size == 1 or eager:
            self.last_path = "eager"
            self._reduce_rows(flat, send.size, op, code, prescale)
        else:
            if out.ctypes.data != send.ctypes.data:
                np.copyto(out, send)
            reduce.scale(flat, prescale, code)
            if code in _MPI_NATIVE and send.nbytes < self.settings.ring_threshold:
                self.last_path = "mpi"
                self._mpi_allreduce(flat, op, code)
            else:
                self.last_path = "ring"
                ring.allreduce(self._data, flat, _ring_op(op), code, self._scratch)
        if postscale != 1.0:
            reduce.scale(flat, postscale, code)

    def _payload_rows(self, code: DType, count: int) -> list[np.ndarray]:
        """Each rank's eager payload viewed as `count` elements of `code` (cached views)."""
        key = (code, count)
        rows = self._row_views.get(key)
        if rows is None:
            end = HEADER_BYTES + count * code.itemsize
            rows = [row[HEADER_BYTES:end].view(code.storage) for row in self._messages]
            if len(self._row_views) > 64:
                self._row_views.clear()
            self._row_views[key] = rows
        return rows

    def _reduce_rows(
        self, out: np.ndarray, count: int, op: ReduceOp, code: DType, prescale: float
    ) -> None:
        """Reduce the eager payloads of all ranks, in rank order, into `out` (flat)."""
        rows = self._payload_rows(code, count)
        ring_op = _ring_op(op)
        if code in (DType.FLOAT16, DType.BFLOAT16):
            acc = reduce.widen(rows[0], code)
            acc *= np.float32(prescale)
            for row in rows[1:]:
                other = reduce.widen(row, code)
                other *= np.float32(prescale)
                reduce.combine(acc, other, ring_op, DType.FLOAT32)
            reduce.narrow(acc, out, code)
        elif prescale == 1.0 and len(rows) > 1:
            reduce.combine_into(out, rows[0], rows[1], ring_op, code)
            for row in rows[2:]:
                reduce.combine(out, row, ring_op, code)
        else:
            out[...] = rows[0]
            reduce.scale(out, prescale, code)
            for row in rows[1:]:
                if prescale != 1.0:
                    row = row.copy()
                    reduce.scale(row, prescale, code)
                reduce.combine(out, row, ring_op, code)

    def _mpi_allreduce(self, flat: np.ndarray, op: ReduceOp, code: DType) -> None:
        from mpi4py import MPI

        if code is DType.BOOL:
            mpi_op = MPI.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else MPI.MIN
            flat = flat.view(np.uint8)
        else:
            mpi_op = {
                ReduceOp.AVERAGE: MPI.SUM,
                ReduceOp.SUM: MPI.SUM,
                ReduceOp.MIN: MPI.MIN,
                ReduceOp.MAX: MPI.MAX,
                ReduceOp.PRODUCT: MPI.PROD,
            }[op]
        self._data.Allreduce(MPI.IN_PLACE, flat, mpi_op)

    def allgather(self, send: np.ndarray, code: DType, name: str | None = None) -> np.ndarray:
        """Concatenate every rank's `send` along the first dimension (which may differ)."""
        self._agree(Kind.ALLGATHER, name, code=code, shape=send.shape, nbytes=send.nbytes)
        counts = self._headers[:, H_DIM0].copy()
        out = np.empty((int(counts.sum()), *send.shape[1:]), code.storage)
        if self.size == 1:
            out[...] = send
            return out
        from mpi4py import MPI

        row_bytes = send.nbytes // send.shape[0] if send.shape[0] else _row_bytes(send)
        byte_counts = counts * row_bytes
        displs = np.concatenate(([0], np.cumsum(byte_counts)[:-1]))
        self._data.Allgatherv(
            [send.reshape(-1).view(np.uint8), MPI.BYTE],
            [out.reshape(-1).view(np.uint8), (byte_counts, displs), MPI.BYTE],
        )
        return out

    def broadcast(self, buf: np.ndarray, root: int, code: DType, name: str | None = None) -> None:
        """Overwrite `buf` on every rank with root's `buf` (in place)."""
        error = _capture(_check_root, root, self.size)
        eager = buf.nbytes <= self.eager_bytes
        self._agree(
            Kind.BROADCAST,
            name,
            code=code,
            root=root,
            shape=buf.shape,
            nbytes=buf.nbytes,
            payload=buf if eager and root == self.rank else None,
            error=error,
        )
        if self.size == 1:
            return
        flat = buf.reshape(-1).view(np.uint8)
        if not eager:
            self._data.Bcast(flat, root)
        elif root != self.rank:
            flat[...] = self._messages[root, HEADER_BYTES : HEADER_BYTES + buf.nbytes]

    def reducescatter(
        self,
        send: np.ndarray,
        op: ReduceOp,
        code: DType,
        prescale: float = 1.0,
        postscale: float = 1.0,
        name: str | None = None,
    ) -> np.ndarray:
        """Reduce `send` over ranks and return this rank's block of rows (rank r gets block
        r of the first dimension split as evenly as possible, earlier ranks one row more)."""
        if send.ndim == 0:
            error: BaseException | None = ValueError(
                "reducescatter needs an array with at least one dimension to split."
            )
        else:
            error = _capture(reduce.check_op, op, code, prescale, postscale)
        eager = send.nbytes <= self.eager_bytes
        self._agree(
            Kind.REDUCESCATTER,
            name,
            op=op,
            code=code,
            shape=send.shape,
            nbytes=send.nbytes,
            payload=send if eager else None,
            error=error,
        )
        if op is ReduceOp.AVERAGE:
            postscale = postscale / self.size
        row_elems = send.size // send.shape[0] if send.shape[0] else 0
        rows = ring.even_bounds(send.shape[0], self.size)
        lo, hi = rows[self.rank] * row_elems, rows[self.rank + 1] * row_elems
        work = np.empty(send.size, code.storage)
        if self.size == 1 or eager:
            self._reduce_rows(work, send.size, op, code, prescale)
        else:
            work[...] = send.reshape(-1)
            reduce.scale(work, prescale, code)
            bounds = [b * row_elems for b in rows]
            ring.reduce_scatter(self._data, work, bounds, _ring_op(op), code, self._scratch, 1)
        out = work[lo:hi].reshape((rows[self.rank + 1] - rows[self.rank], *send.shape[1:]))
        reduce.scale(out.reshape(-1), postscale, code)
        return out

    def alltoall(
        self,
        send: np.ndarray,
        splits: Sequence[int] | None,
        code: DType,
        name: str | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Send block i of `send` (rows split by `splits`) to rank i; return what arrived,
        concatenated in rank order, and how many rows came from each rank."""
        send_rows, error = _alltoall_splits(send, splits, self.size)
        self._agree(
            Kind.ALLTOALL, name, code=code, shape=send.shape, nbytes=send.nbytes, error=error
        )
        if self.size == 1:
            return send.copy(), send_rows.copy()
        from mpi4py import MPI

        recv_rows = np.empty(self.size, np.int64)
        self._data.Alltoall(send_rows, recv_rows)
        row_bytes = _row_bytes(send)
        out = np.empty((int(recv_rows.sum()), *send.shape[1:]), code.storage)
        send_counts, recv_counts = send_rows * row_bytes, recv_rows * row_bytes
        self._data.Alltoallv(
            [send.reshape(-1).view(np.uint8), (send_counts, _displacements(send_counts)), MPI.BYTE],
            [out.reshape(-1).view(np.uint8), (recv_counts, _displacements(recv_counts)), MPI.BYTE],
        )
        return out, recv_rows

    def barrier(self, name: str | None = None) -> None:
        """Return once every rank has called barrier (the header exchange is the barrier)."""
        self._agree(Kind.BARRIER, name)

    def broadcast_object(self, obj: Any, root: int, name: str | None = None) -> Any:
        """Root's picklable `obj` on every rank."""
        data, error = b"", _capture(_check_root, root, self.size)
        if error is None and root == self.rank:
            data, error = _pickle(obj)
        payload = np.frombuffer(data, np.uint8)
        eager = len(data) <= self.eager_bytes
        headers = self._agree(
            Kind.BROADCAST_OBJECT,
            name,
            root=root,
            nbytes=len(data),
            payload=payload if eager else None,
            error=error,
        )
        if self.size == 1:
            return obj
        length = int(headers[root, H_NBYTES])
        if length > self.eager_bytes:
            # mpi4py needs a writable buffer for Bcast, on the root too.
            buffer = (
                np.frombuffer(bytearray(data), np.uint8)
                if root == self.rank
                else (np.empty(length, np.uint8))
            )
            self._data.Bcast(buffer, root)
        else:
            buffer = self._messages[root, HEADER_BYTES : HEADER_BYTES + length]
        return obj if root == self.rank else pickle.loads(buffer)

    def allgather_object(self, obj: Any, name: str | None = None) -> list[Any]:
        """Every rank's picklable `obj`, as a list in rank order."""
        data, error = _pickle(obj)
        headers = self._agree(Kind.ALLGATHER_OBJECT, name, nbytes=len(data), error=error)
        if self.size == 1:
            return [obj]
        from mpi4py import MPI

        lengths = headers[:, H_NBYTES].copy()
        buffer = np.empty(int(lengths.sum()), np.uint8)
        displs = _displacements(lengths)
        self._data.Allgatherv(
            [np.frombuffer(data, np.uint8), MPI.BYTE], [buffer, (lengths, displs), MPI.BYTE]
        )
        return [pickle.loads(buffer[d : d + n]) for d, n in zip(displs, lengths, strict=True)]


# ---------------------------------------------------------------------- helpers
def _ring_op(op: ReduceOp) -> ReduceOp:
    return ReduceOp.SUM if op is ReduceOp.AVERAGE else op


def _capture(check: Any, *args: Any) -> BaseException | None:
    try:
        check(*args)
    except (TypeError, ValueError) as exc:
        return exc
    return None


def _check_root(root: int, size: int) -> None:
    if not 0 <= root < size:
        raise ValueError(f"root_rank={root} is not a rank of this job (ranks are 0..{size - 1}).")


def _pickle(obj: Any) -> tuple[bytes, BaseException | None]:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the caller's bad input
        return b"", TypeError(f"Cannot pickle {type(obj).__name__} to send it: {exc}")


def _row_bytes(array: np.ndarray) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize


def _displacements(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


def _alltoall_splits(
    send: np.ndarray, splits: Sequence[int] | None, size: int
) -> tuple[np.ndarray, BaseException | None]:
    rows = np.zeros(size, np.int64)
    if send.ndim == 0:
        return rows, ValueError("alltoall needs an array with at least one dimension.")
    if splits is None:
        if send.shape[0] % size:
            return rows, ValueError(
                f"alltoall without splits divides the first dimension ({send.shape[0]}) "
                f"evenly over {size} ranks; pass splits= to send uneven blocks."
            )
        rows[:] = send.shape[0] // size
        return rows, None
    given = np.asarray(splits, dtype=np.int64).reshape(-1)
    if given.size != size or (given < 0).any() or given.sum() != send.shape[0]:
        return rows, ValueError(
            f"alltoall splits must be {size} non-negative row counts summing to the first "
            f"dimension ({send.shape[0]}); got {list(map(int, given))}."
        )
    return given, None


def _byte_view(array: np.ndarray) -> memoryview | np.ndarray:
    try:
        return memoryview(array).cast("B")
    except (TypeError, ValueError):  # formats memoryview cannot cast (e.g. ml_dtypes)
        return array.reshape(-1).view(np.uint8)


def _shape_text(header: np.ndarray) -> str:
    ndim = int(header[H_NDIM])
    if ndim == 0:
        return "()"
    trailing = [int(d) for d in header[H_TRAILING : H_TRAILING + min(ndim - 1, TRAILING_SLOTS)]]
    dims = [int(header[H_DIM0]), *trailing]
    if ndim - 1 > TRAILING_SLOTS:
        return "(" + ", ".join(map(str, dims[:-1])) + f", ... ({ndim} dims))"
    return "(" + ", ".join(map(str, dims)) + ("," if ndim == 1 else "") + ")"


def _describe(header: np.ndarray) -> str:
    """What one rank's header says it called, with the fields that call must match on."""
    if int(header[H_MAGIC]) != _MAGIC:
        return "a message that is not a ringplug header (mixed ringplug versions?)"
    value = int(header[H_KIND])
    if value not in Kind._value2member_map_:
        return f"an unknown collective ({value})"
    kind = Kind(value)
    fields = _MATCH[kind]
    parts = [f"{kind.label} #{int(header[H_SEQ])}"]
    if "shape" in fields or "trailing" in fields:
        parts.append(f"with shape {_shape_text(header)}")
    if "dtype" in fields:
        code = int(header[H_DTYPE])
        parts.append(DType(code).label if code in DType._value2member_map_ else "?")
    if "op" in fields:
        op = int(header[H_OP])
        parts.append(f"op={ReduceOp(op).name.lower() if op in ReduceOp._value2member_map_ else op}")
    if "root" in fields:
        parts.append(f"root_rank={int(header[H_ROOT])}")
    return " ".join(parts)


def _mismatch_message(kind: Kind, name: str | None, seq: int, headers: np.ndarray) -> str:
    groups: dict[str, list[int]] = {}
    for rank in range(headers.shape[0]):
        groups.setdefault(_describe(headers[rank]), []).append(rank)
    lines = [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} called {text}"
        for text, ranks in groups.items()
    ]
    hint = (
        f"{kind.label} lets the first dimension differ, but not the others or the dtype. "
        if kind in (Kind.ALLGATHER, Kind.ALLTOALL)
        else ""
    )
    return (
        f"{_what(kind, name, seq)} does not match across ranks: "
        + "; ".join(lines)
        + ". "
        + hint
        + "Every rank must call the same collectives in the same order with the same shapes, "
        "dtypes, ops and root ranks; check that every rank builds the same model and reads "
        "the same config."
    )


def _what(kind: Kind, name: str | None, seq: int) -> str:
    return f"{kind.label} #{seq}" + (f" ({name!r})" if name else "")
