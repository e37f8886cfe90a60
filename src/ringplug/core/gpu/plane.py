"""The GPU data plane: the engine's collectives on device buffers, through NCCL.

The engine thread owns it. On the first GPU collective (which every rank reaches at the
same point of the same plan) it selects this rank's GPU for the engine thread, rank 0
makes an NCCL unique id, MPI broadcasts it, and every rank joins one communicator. Work
is ordered against the framework with events: the engine's stream waits for the event
recorded where the caller submitted the tensors, runs the copies and NCCL calls, and the
engine completes the handles only once that work has finished, so results can be used on
any stream. While it waits it polls NCCL's asynchronous error state: a peer that died
(ncclRemoteError) aborts the communicator and fails every pending collective instead of
hanging. Every wait (joining the communicator, each collective) is the engine's own
(`waiting.Waiter`): a stall warning at RINGPLUG_STALL_CHECK_SECONDS and, at
RINGPLUG_TIMEOUT, an abort of the communicator whose error names the rank that stopped
taking part (ringrun names it as the job's root cause).

Scale factors of Sum and Average (including Average's 1/size) are applied inside NCCL
(a pre-multiplied sum), so they cost no pass of their own.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...config import Settings
from ..dtypes import DType
from ..errors import CommunicatorFailed, NcclError
from ..ops import ReduceOp
from ..transport import ring
from . import nccl
from .cuda import CudaError, DeviceRuntime, default_runtime
from .device import DeviceBuffer, nccl_type

logger = logging.getLogger(__name__)

_NCCL_OPS = {
    ReduceOp.SUM: nccl.OP_SUM,
    ReduceOp.AVERAGE: nccl.OP_SUM,
    ReduceOp.PRODUCT: nccl.OP_PROD,
    ReduceOp.MAX: nccl.OP_MAX,
    ReduceOp.MIN: nccl.OP_MIN,
}
_CLOSE_SECONDS = 10.0  # at most, for the communicator's last work at shutdown


def device_for_local_rank(local_rank: int, visible: int) -> int:
    """The GPU index (among the visible ones) a rank uses.

    One rank per GPU: local rank i takes visible GPU i. Where a launcher or scheduler
    already gave each rank a single GPU (CUDA_VISIBLE_DEVICES per rank), that is GPU 0.
    """
    if visible <= 0:
        raise CudaError(
            "No GPU is visible to this process (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); check `nvidia-smi`, or keep "
            "tensors on the CPU."
        )
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise CudaError(
            f"Local rank {local_rank} has no GPU of its own: {visible} are visible on this host, "
            "and NCCL cannot put two ranks on one GPU. Start at most as many ranks per host as "
            "there are GPUs (ringrun -H host:GPUS)."
        )
    return local_rank


def scalar_bytes(value: float, code: DType) -> bytes:
    """One element of `code` holding `value`, as NCCL reads a host scalar; rounded to
    nearest even as torch rounds (1/3 in bfloat16 is 0x3EAB: truncating gives 0x3EAA, and
    Average over 3 ranks biased low)."""
    if code is DType.BFLOAT16:
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
        if bits & 0x7FFFFFFF > 0x7F800000:  # NaN stays NaN
            return struct.pack("<H", (bits >> 16) | 0x40)
        return struct.pack("<H", ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)
    storage = {DType.FLOAT16: np.float16, DType.FLOAT32: np.float32, DType.FLOAT64: np.float64}[
        code
    ]
    return np.asarray(value, storage).tobytes()


def _fatal_on_error(method: Callable[..., Any]) -> Callable[..., Any]:
    """An NCCL or CUDA error inside a collective leaves the ranks out of step (some may
    have enqueued their part): abort the communicator, so every GPU collective of this
    process fails from now on instead of waiting for a partner that will not come."""

    @functools.wraps(method)
    def guarded(self: GpuPlane, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except CommunicatorFailed:
            raise
        except (NcclError, CudaError) as error:
            self._abort(str(error), error.code if isinstance(error, NcclError) else -1)

    return guarded


class GpuPlane:
    """NCCL collectives for the engine thread, with a device fusion buffer."""

    def __init__(self, transport: Any, settings: Settings, local_rank: int) -> None:
        self.transport, self.settings = transport, settings
        self.rank, self.size, self.local_rank = transport.rank, transport.size, local_rank
        self.runtime: DeviceRuntime | None = None
        self.comm: nccl.Communicator | None = None
        self.stream: Any = None
        self.device = -1
        self._fusion: tuple[int, Any, int] | None = None  # (address, owner, bytes)
        self.failure: CommunicatorFailed | None = None

    # ------------------------------------------------------------------ set-up
    def _ensure(self) -> tuple[nccl.Communicator, DeviceRuntime, Any]:
        if self.failure is not None:
            raise self.failure
        if self.comm is None:
            library = nccl.load()
            runtime = default_runtime()
            self.device = device_for_local_rank(self.local_rank, runtime.device_count())
            runtime.set_device(self.device)  # per thread: this is the engine thread
            uid = nccl.unique_id(library) if self.rank == 0 else b""
            uid = self.transport.broadcast_bytes(uid, nccl.UNIQUE_ID_BYTES, 0)
            comm = nccl.Communicator(
                library, uid, self.size, self.rank, self.device, blocking=False
            )
            self.comm = comm
            # Every rank joins under the engine's deadline: one that never arrives is named
            # as every other wait names it (its peers hear nothing from it), and one whose
            # NCCL refused it ends its engine, which tells the others at once.
            self._wait(comm.ready, f"NCCL communicator init on GPU {self.device}", "joining")
            self.runtime, self.stream = runtime, runtime.new_stream()
            logger.info(
                "rank %d: NCCL %s communicator on GPU %d (%s)",
                self.rank,
                library.path,
                self.device,
                runtime.name,
            )
        return self.comm, self.runtime, self.stream  # type: ignore[return-value]

    def close(self) -> None:
        """Free the communicator; one whose work does not finish within the timeout (a peer
        gone mid-collective) is aborted: shutdown never waits for ever."""
        if self.comm is not None:
            if not self.comm.close(min(self.settings.timeout, _CLOSE_SECONDS)):
                logger.debug("rank %d: the NCCL communicator was aborted at shutdown", self.rank)
            self.comm = None
        self._fusion = None

    def _wait(self, done: Callable[[], bool], what: str, phase: str) -> None:
        """Wait for `done` under the engine's deadline (RINGPLUG_TIMEOUT), with its stall
        check and the notices that name a peer that stopped taking part; at the deadline
        the communicator is aborted (NCCL's work, unlike MPI's, can be cancelled)."""
        waiter = self.transport.waiter
        before = waiter.what
        waiter.what = what

        def give_up(verdict: str, culprits: list[int]) -> None:
            self._abort(verdict, nccl.TIMEOUT, tuple(culprits))

        try:
            waiter.wait(done, phase, give_up=give_up)
        finally:
            waiter.what = before

    # ------------------------------------------------------------------ ordering
    def _wait_ready(self, events: Sequence[Any]) -> None:
        runtime, stream = self.runtime, self.stream
        assert runtime is not None
        for event in events:
            if event is None:
                continue
            try:
                runtime.wait_event(stream, event)
            except (AttributeError, TypeError):
                event.synchronize()  # another framework's event: wait on the host

    def _complete(self, what: str) -> None:
        """Block until the enqueued work has finished; abort on a peer's failure, and at
        the timeout with an error naming the peer that stopped taking part."""
        comm, runtime = self.comm, self.runtime
        assert comm is not None and runtime is not None
        event = runtime.record(self.stream)

        def done() -> bool:
            finished = runtime.query(event)
            # Asked after the event too: work that ended because its communicator failed
            # left no result to use.
            error = comm.async_error()
            if error not in (nccl.SUCCESS, nccl.IN_PROGRESS):
                self._abort(comm.describe(error, f"{what} (asynchronous error)"), error)
            return finished

        self._wait(done, what, "NCCL")

    def _abort(self, message: str, code: int = -1, culprits: tuple[int, ...] = ()) -> None:
        if self.comm is not None:
            self.comm.abort()
        prefix = "" if message.startswith(f"rank {self.rank} ") else f"rank {self.rank}: "
        self.failure = CommunicatorFailed(
            f"{prefix}{message} The NCCL communicator was aborted; GPU collectives cannot "
            "continue in this process.",
            code,
            caused_by=culprits,
        )
        raise self.failure

    def _scratch(self, nbytes: int) -> tuple[int, Any]:
        assert self.runtime is not None
        return self.runtime.alloc(nbytes)

    def _fusion_buffer(self, nbytes: int) -> int:
        if self._fusion is None or self._fusion[2] < nbytes:
            size = max(nbytes, min(self.settings.fusion_threshold, 4 * nbytes))
            address, owner = self._scratch(size)
            self._fusion = (address, owner, size)
        return self._fusion[0]

    def _identity(self, values: np.ndarray, code: DType) -> DeviceBuffer:
        """A device copy of a joined rank's identity values (host array, storage type)."""
        assert self.runtime is not None
        address, owner = self._scratch(values.nbytes)
        self.runtime.upload(address, values, self.stream)
        return DeviceBuffer(address, values.size, code, self.device, owner)

    def _op(self, op: ReduceOp, code: DType, factor: float) -> tuple[int, bool]:
        """NCCL's op for `op` with the product of the scale factors folded in (Sum and
        Average only), and whether it must be destroyed after use."""
        assert self.comm is not None
        if op in (ReduceOp.SUM, ReduceOp.AVERAGE) and factor != 1.0:
            return self.comm.premul_sum(scalar_bytes(factor, code), nccl_type(code)), True
        if code is DType.BOOL:  # as on the CPU: Sum is logical or, Product logical and
            return {ReduceOp.SUM: nccl.OP_MAX, ReduceOp.PRODUCT: nccl.OP_MIN}.get(
                op, _NCCL_OPS[op]
            ), False
        return _NCCL_OPS[op], False

    # ------------------------------------------------------------------ collectives
    @_fatal_on_error
    def allreduce(
        self,
        items: Sequence[tuple[DeviceBuffer | np.ndarray, DeviceBuffer | None, float, float]],
        code: DType,
        op: ReduceOp,
        ready: Sequence[Any],
    ) -> None:
        """Reduce every item in place of its output.

        An item is (input, output, prescale, postscale); a joined rank's item has a host
        array of identity values as input and no output.
        """
        comm, runtime, stream = self._ensure()
        self._wait_ready(ready)
        dtype, handle = nccl_type(code), runtime.stream_handle(stream)
        size_factor = 1.0 / self.size if op is ReduceOp.AVERAGE else 1.0
        groups: dict[tuple[float, float], list[tuple[DeviceBuffer, DeviceBuffer]]] = {}
        for send, out, pre, post in items:
            if isinstance(send, np.ndarray):
                send = out = self._identity(send, code)
            groups.setdefault((pre, post), []).append((send, out))
        sums = op in (ReduceOp.SUM, ReduceOp.AVERAGE)
        itemsize = code.itemsize
        for (pre, post), group in groups.items():
            nccl_op, destroy = self._op(op, code, pre * post * size_factor if sums else 1.0)
            # Min, Max and Product take their scale factors as passes of their own.
            by_hand_pre, by_hand_post = (1.0, 1.0) if sums else (pre, post)
            total = sum(out.count for _, out in group)
            if len(group) > 1 and total * itemsize <= self.settings.fusion_threshold:
                fusion = self._fusion_buffer(total * itemsize)
                offset = 0
                for send, out in group:
                    runtime.copy(fusion + offset, send.address, out.nbytes, stream)
                    offset += out.nbytes
                if by_hand_pre != 1.0:
                    runtime.scale(fusion, total, code, by_hand_pre, stream)
                comm.allreduce(fusion, fusion, total, dtype, nccl_op, handle)
                if by_hand_post != 1.0:
                    runtime.scale(fusion, total, code, by_hand_post, stream)
                offset = 0
                for _, out in group:
                    runtime.copy(out.address, fusion + offset, out.nbytes, stream)
                    offset += out.nbytes
            else:
                comm.group_start()
                try:
                    for send, out in group:
                        source = send.address
                        if by_hand_pre != 1.0:
                            runtime.copy(out.address, send.address, out.nbytes, stream)
                            runtime.scale(out.address, out.count, code, by_hand_pre, stream)
                            source = out.address
                        comm.allreduce(source, out.address, out.count, dtype, nccl_op, handle)
                finally:
                    comm.group_end()
                if by_hand_post != 1.0:
                    for _, out in group:
                        runtime.scale(out.address, out.count, code, by_hand_post, stream)
            if destroy:
                comm.destroy_op(nccl_op)
        self._complete(f"allreduce of {len(items)} GPU tensor(s)")

    @_fatal_on_error
    def broadcast(
        self, buffer: DeviceBuffer | None, count: int, code: DType, root: int, ready: Any
    ) -> DeviceBuffer:
        """Overwrite `buffer` with root's (a joined rank passes None and gets scratch)."""
        comm, runtime, stream = self._ensure()
        self._wait_ready([ready])
        if buffer is None:
            address, owner = self._scratch(count * code.itemsize)
            buffer = DeviceBuffer(address, count, code, self.device, owner)
        comm.broadcast(
            buffer.address,
            buffer.address,
            count,
            nccl_type(code),
            root,
            runtime.stream_handle(stream),
        )
        self._complete("broadcast of a GPU tensor")
        return buffer

    @_fatal_on_error
    def allgather(
        self,
        send: DeviceBuffer | None,
        rows: Sequence[int],
        row_elems: int,
        code: DType,
        ready: Any,
        out: DeviceBuffer | None = None,
    ) -> DeviceBuffer:
        """Every rank's rows, concatenated in rank order (rows may differ between ranks)."""
        comm, runtime, stream = self._ensure()
        self._wait_ready([ready])
        total = sum(rows) * row_elems
        if out is None:
            address, owner = self._scratch(total * code.itemsize)
            out = DeviceBuffer(address, total, code, self.device, owner)
        dtype, handle = nccl_type(code), runtime.stream_handle(stream)
        if len(set(rows)) == 1:
            source = send.address if send is not None else out.address
            comm.allgather(source, out.address, rows[0] * row_elems, dtype, handle)
        else:  # uneven rows: each rank broadcasts its block into place, as one group
            comm.group_start()
            try:
                offset = 0
                for rank, count in enumerate(rows):
                    count *= row_elems
                    if count:
                        target = out.address + offset * code.itemsize
                        source = send.address if rank == self.rank and send else target
                        comm.broadcast(source, target, count, dtype, rank, handle)
                    offset += count
            finally:
                comm.group_end()
        self._complete("allgather of a GPU tensor")
        return out

    @_fatal_on_error
    def reducescatter(
        self,
        send: DeviceBuffer | np.ndarray,
        rows: int,
        row_elems: int,
        code: DType,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        ready: Any,
    ) -> DeviceBuffer:
        """This rank's block (`ring.even_bounds` rows) of the reduction of `send`."""
        comm, runtime, stream = self._ensure()
        self._wait_ready([ready])
        if isinstance(send, np.ndarray):  # a joined rank contributes identity values
            send = self._identity(send, code)
        bounds = ring.even_bounds(rows, self.size)
        lo, hi = bounds[self.rank] * row_elems, bounds[self.rank + 1] * row_elems
        sums = op in (ReduceOp.SUM, ReduceOp.AVERAGE)
        factor = prescale * postscale * (1.0 / self.size if op is ReduceOp.AVERAGE else 1.0)
        nccl_op, destroy = self._op(op, code, factor if sums else 1.0)
        source = send
        if not sums and prescale != 1.0:
            address, owner = self._scratch(send.nbytes)
            runtime.copy(address, send.address, send.nbytes, stream)
            runtime.scale(address, send.count, code, prescale, stream)
            source = DeviceBuffer(address, send.count, code, self.device, owner)
        dtype, handle = nccl_type(code), runtime.stream_handle(stream)
        if rows % self.size == 0:
            address, owner = self._scratch((hi - lo) * code.itemsize)
            result = DeviceBuffer(address, hi - lo, code, self.device, owner)
            comm.reducescatter(source.address, address, hi - lo, dtype, nccl_op, handle)
        else:  # uneven blocks: NCCL's reduce-scatter needs equal ones
            address, owner = self._scratch(send.nbytes)
            comm.allreduce(source.address, address, send.count, dtype, nccl_op, handle)
            result = DeviceBuffer(address, send.count, code, self.device, owner).part(lo, hi - lo)
        if destroy:
            comm.destroy_op(nccl_op)
        if not sums and postscale != 1.0:
            runtime.scale(result.address, result.count, code, postscale, stream)
        self._complete("reducescatter of a GPU tensor")
        return result
