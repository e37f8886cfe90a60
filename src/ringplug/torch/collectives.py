"""ringplug's collectives on torch tensors: the core's, with tensors in and tensors out.

CPU tensors reach the core without a copy: the core works on a numpy view of the tensor's
memory (bfloat16 as its raw 16-bit words). CUDA tensors go to the GPU data plane (NCCL) by
address, ordered after the work already queued on the caller's current stream; results
are ready for any stream when `wait()` returns. Non-contiguous tensors go through a
contiguous copy. The forms ending in ``_`` work in place; the ``_async`` forms return a handle whose
``wait()`` gives the tensor. Every rank must call the same collectives in the same order
(or under the same ``name``), as for the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..core import collectives as core
from ..core import device_collectives as device
from ..core.dtypes import DType
from ..core.engine.handles import Handle
from ..core.gpu.device import DeviceBuffer
from ..core.ops import Average, ReduceOp

# torch dtype -> (the dtype the core reads the bytes as, or None to use the tensor's own)
_SUPPORTED: dict[torch.dtype, str | None] = {
    torch.float16: None,
    torch.bfloat16: "bfloat16",
    torch.float32: None,
    torch.float64: None,
    torch.int8: None,
    torch.int16: None,
    torch.int32: None,
    torch.int64: None,
    torch.uint8: None,
    torch.bool: None,
}
_CODES = {
    torch.float16: DType.FLOAT16,
    torch.bfloat16: DType.BFLOAT16,
    torch.float32: DType.FLOAT32,
    torch.float64: DType.FLOAT64,
    torch.int8: DType.INT8,
    torch.int16: DType.INT16,
    torch.int32: DType.INT32,
    torch.int64: DType.INT64,
    torch.uint8: DType.UINT8,
    torch.bool: DType.BOOL,
}


class TensorHandle:
    """A collective on tensors in flight; `wait()` returns the tensor result."""

    def __init__(self, handle: Handle, finish: Any) -> None:
        self._handle = handle
        self._finish = finish

    def done(self) -> bool:
        return self._handle.done()

    def wait(self, timeout: float | None = None) -> Any:
        return self._finish(self._handle.wait(timeout))

    synchronize = wait


def _check(tensor: torch.Tensor, what: str, name: str | None) -> None:
    """Refuse what the core cannot take, failing the matching call on every other rank too."""
    if not isinstance(tensor, torch.Tensor):
        core.reject(TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}."), name)
    if tensor.dtype not in _SUPPORTED:
        names = ", ".join(str(d).removeprefix("torch.") for d in _SUPPORTED)
        core.reject(
            TypeError(
                f"{what}: unsupported dtype {tensor.dtype}; ringplug reduces {names}. "
                "Convert the tensor first (for example with .float())."
            ),
            name,
        )
    if tensor.device.type not in ("cpu", "cuda"):
        core.reject(
            NotImplementedError(
                f"{what}: ringplug reduces CPU and CUDA tensors, not tensors on {tensor.device}; "
                "move the tensor first (.cpu())."
            ),
            name,
        )


def _on_gpu(tensors: Sequence[torch.Tensor], what: str, name: str | None) -> bool:
    """Whether the request goes to the GPU plane; refuses a mix of CPU and CUDA tensors."""
    kinds = {tensor.device.type for tensor in tensors}
    if len(kinds) > 1:
        core.reject(
            ValueError(
                f"{what}: one request mixes CPU and CUDA tensors ({', '.join(sorted(kinds))}); "
                "the CPU ring and NCCL cannot reduce them together. Move them to one device, or "
                "make one request per device."
            ),
            name,
        )
    return kinds == {"cuda"}


def device_buffer(tensor: torch.Tensor) -> DeviceBuffer:
    """A contiguous CUDA tensor's memory, for the GPU data plane (the tensor is its owner)."""
    return DeviceBuffer(
        tensor.data_ptr(), tensor.numel(), _CODES[tensor.dtype], tensor.device.index, tensor
    )


def _ready(tensor: torch.Tensor) -> Any:
    """An event after the work queued so far on the caller's stream (which made `tensor`)."""
    return torch.cuda.current_stream(tensor.device).record_event()


def tensor_from_buffer(
    buffer: DeviceBuffer, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """A tensor over device memory the GPU plane allocated (a torch uint8 tensor owns it)."""
    owner = buffer.owner
    start = buffer.address - owner.data_ptr()
    raw = owner.reshape(-1)[start : start + buffer.nbytes]
    return raw.view(dtype).reshape(tuple(shape))


def as_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """A numpy view of a contiguous CPU tensor's memory, and the dtype the core reads it as."""
    if tensor.dtype is torch.bfloat16:
        return tensor.detach().view(torch.int16).numpy().view(np.uint16), "bfloat16"
    return tensor.detach().numpy(), None


def from_numpy(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A tensor over `array`'s memory with `like`'s dtype (bfloat16 from its raw words)."""
    if like.dtype is torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def allreduce_async(
    tensor: torch.Tensor,
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start an allreduce of `tensor` into a new tensor (the input is not changed)."""
    _check(tensor, "allreduce", name)
    result = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _allreduce_into(result, op, name, prescale_factor, postscale_factor, lambda: result)


def _device_allreduce(
    works: list[torch.Tensor], op, name, prescale, postscale, finish
) -> TensorHandle:
    buffers = [device_buffer(work) for work in works]
    handle = device.allreduce_async(
        buffers,
        buffers,
        [tuple(work.shape) for work in works],
        op,
        name=name,
        prescale_factor=prescale,
        postscale_factor=postscale,
        ready=_ready(works[0]),
    )
    return TensorHandle(handle, finish)


def allreduce_async_(
    tensor: torch.Tensor,
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start an allreduce of `tensor` in place; `wait()` returns `tensor`."""
    _check(tensor, "allreduce_", name)
    if tensor.is_contiguous():
        return _allreduce_into(tensor, op, name, prescale_factor, postscale_factor, lambda: tensor)
    work = tensor.detach().contiguous()

    def write_back() -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(work)
        return tensor

    return _allreduce_into(work, op, name, prescale_factor, postscale_factor, write_back)


def _allreduce_into(work, op, name, prescale, postscale, finish) -> TensorHandle:
    if work.is_cuda:
        return _device_allreduce([work], op, name, prescale, postscale, lambda _: finish())
    array, dtype = as_numpy(work)
    handle = core.allreduce_async(
        array,
        op,
        out=array,
        name=name,
        dtype=dtype,
        prescale_factor=prescale,
        postscale_factor=postscale,
    )
    return TensorHandle(handle, lambda _: finish())


def allreduce(tensor: torch.Tensor, op: ReduceOp | str = Average, **kwargs: Any) -> torch.Tensor:
    """The elementwise reduction of `tensor` over every rank, as a new tensor."""
    return allreduce_async(tensor, op, **kwargs).wait()


def allreduce_(tensor: torch.Tensor, op: ReduceOp | str = Average, **kwargs: Any) -> torch.Tensor:
    """Reduce `tensor` over every rank in place; returns `tensor`."""
    return allreduce_async_(tensor, op, **kwargs).wait()


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start one allreduce of several tensors of one dtype, each in place; `wait()` returns
    the list. One negotiation and one fused pass, reduced where the tensors lie (no copy
    into a fusion buffer); non-contiguous tensors go through a contiguous copy."""
    tensors = list(tensors)
    for tensor in tensors:
        _check(tensor, "grouped_allreduce_", name)
    if not tensors:
        core.reject(ValueError("grouped_allreduce_ needs at least one tensor."), name)
    if len({tensor.dtype for tensor in tensors}) > 1:
        core.reject(
            TypeError("grouped_allreduce_ needs tensors of one dtype; group them by dtype."), name
        )
    works = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in tensors]

    def write_back(_: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            for tensor, work in zip(tensors, works, strict=True):
                if work.data_ptr() != tensor.data_ptr():
                    tensor.copy_(work)
        return tensors

    if _on_gpu(tensors, "grouped_allreduce_", name):
        return _device_allreduce(works, op, name, prescale_factor, postscale_factor, write_back)
    arrays = [as_numpy(work)[0] for work in works]
    handle = core.grouped_allreduce_async(
        arrays,
        op,
        out=arrays,
        name=name,
        dtype=as_numpy(works[0])[1],
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )
    return TensorHandle(handle, write_back)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor], op: ReduceOp | str = Average, **kwargs: Any
) -> list[torch.Tensor]:
    """Reduce several tensors of one dtype in place, negotiated and fused as one."""
    return grouped_allreduce_async_(tensors, op, **kwargs).wait()


def grouped_allreduce(
    tensors: Sequence[torch.Tensor], op: ReduceOp | str = Average, **kwargs: Any
) -> list[torch.Tensor]:
    """The reductions of several tensors of one dtype, as new tensors (inputs unchanged)."""
    copies = [
        t.detach().clone(memory_format=torch.contiguous_format)
        if isinstance(t, torch.Tensor)
        else t
        for t in tensors
    ]
    return grouped_allreduce_async_(copies, op, **kwargs).wait()


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int = 0,
    *,
    name: str | None = None,
    refuse_joined: bool = False,
) -> TensorHandle:
    """Start overwriting `tensor` with root's, in place; `wait()` returns `tensor`.
    (`refuse_joined`: fail on every rank while a rank has joined, as Horovod.)"""
    _check(tensor, "broadcast_", name)
    work = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
    if work.is_cuda:
        handle = device.broadcast_async(
            device_buffer(work),
            tuple(work.shape),
            root_rank,
            name=name,
            ready=_ready(work),
            refuse_joined=refuse_joined,
        )
    else:
        array, dtype = as_numpy(work)
        handle = core.broadcast_async(
            array, root_rank, out=array, name=name, dtype=dtype, refuse_joined=refuse_joined
        )

    def finish(_: Any) -> torch.Tensor:
        if work.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(work)
        return tensor

    return TensorHandle(handle, finish)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, *, name: str | None = None):
    """Overwrite `tensor` with root's on every rank; returns `tensor`."""
    return broadcast_async_(tensor, root_rank, name=name).wait()


def broadcast(tensor: torch.Tensor, root_rank: int = 0, *, name: str | None = None):
    """Root's `tensor`, as a new tensor on every rank."""
    return broadcast_(
        tensor.detach().clone(memory_format=torch.contiguous_format), root_rank, name=name
    )


def _allgather(tensor: torch.Tensor, name: str | None) -> torch.Tensor:
    return allgather_async(tensor, name=name).wait()


def allgather_async(
    tensor: torch.Tensor, *, name: str | None = None, refuse_joined: bool = False
) -> TensorHandle:
    """Start an allgather; `wait()` returns every rank's `tensor` concatenated (no autograd).
    (`refuse_joined`: fail on every rank while a rank has joined, as Horovod.)"""
    _check(tensor, "allgather", name)
    work = tensor.detach().contiguous()
    if work.is_cuda:
        shape = tuple(work.shape) or (1,)

        def finish(gathered: DeviceBuffer) -> torch.Tensor:
            rows = gathered.count // max(1, int(np.prod(shape[1:], dtype=np.int64)))
            return tensor_from_buffer(gathered, (rows, *shape[1:]), tensor.dtype)

        handle = device.allgather_async(
            device_buffer(work), shape, name=name, ready=_ready(work), refuse_joined=refuse_joined
        )
        return TensorHandle(handle, finish)
    array, dtype = as_numpy(work)
    handle = core.allgather_async(array, name=name, dtype=dtype, refuse_joined=refuse_joined)
    return TensorHandle(handle, lambda gathered: from_numpy(gathered, tensor))


class _AllgatherWithGrad(torch.autograd.Function):
    """allgather whose backward sums every rank's gradient for this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        rows = tensor.shape[0] if tensor.dim() else 1
        counts = core.allgather_object(rows, name=None if name is None else f"{name}.rows")
        ctx.rows = counts
        ctx.rank = int(np.sum(np.asarray(counts)[: _rank()]))
        ctx.scalar = tensor.dim() == 0
        return _allgather(tensor, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        summed = allreduce(grad.contiguous(), "sum")
        mine = summed[ctx.rank : ctx.rank + ctx.rows[_rank()]]
        return (mine.reshape(()) if ctx.scalar else mine), None


def _rank() -> int:
    from ..core import runtime

    return runtime.rank()


def allgather(tensor: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """Every rank's `tensor` concatenated on the first dimension (which may differ).

    Differentiable when `tensor` requires grad: the gradient of each rank's rows is the sum
    of every rank's gradient for them (what Lightning's ``all_gather(sync_grads=True)``
    expects).
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherWithGrad.apply(tensor, name)
    return _allgather(tensor, name)


def reducescatter_async(
    tensor: torch.Tensor, op: ReduceOp | str = Average, *, name: str | None = None
) -> TensorHandle:
    """Start a reducescatter; `wait()` returns this rank's block of rows of the reduction."""
    _check(tensor, "reducescatter", name)
    work = tensor.detach().contiguous()
    if work.is_cuda:
        if work.dim() == 0:
            core.reject(
                ValueError("reducescatter needs a tensor with at least one dimension."), name
            )
        row_elems = max(1, int(np.prod(work.shape[1:], dtype=np.int64)))

        def finish(block: DeviceBuffer) -> torch.Tensor:
            return tensor_from_buffer(
                block, (block.count // row_elems, *work.shape[1:]), tensor.dtype
            )

        handle = device.reducescatter_async(
            device_buffer(work), tuple(work.shape), op, name=name, ready=_ready(work)
        )
        return TensorHandle(handle, finish)
    array, dtype = as_numpy(work)
    handle = core.reducescatter_async(array, op, name=name, dtype=dtype)
    return TensorHandle(handle, lambda block: from_numpy(block, tensor))


def reducescatter(
    tensor: torch.Tensor, op: ReduceOp | str = Average, *, name: str | None = None
) -> torch.Tensor:
    """This rank's block of rows of the reduction of `tensor` over every rank."""
    return reducescatter_async(tensor, op, name=name).wait()


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    *,
    name: str | None = None,
) -> TensorHandle:
    """Start an alltoall; `wait()` returns the rows received and their counts per rank."""
    _check(tensor, "alltoall", name)
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    host = tensor.detach().cpu() if tensor.is_cuda else tensor.detach()
    array, dtype = as_numpy(host.contiguous())

    def finish(result: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        received, counts = result
        return from_numpy(received, tensor).to(tensor.device), torch.from_numpy(counts)

    return TensorHandle(core.alltoall_async(array, splits, name=name, dtype=dtype), finish)


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    *,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send rows `splits[i]` of `tensor` to rank i; returns the rows received and their counts.

    CUDA tensors travel through host memory (NCCL has no alltoall with per-rank splits).
    """
    return alltoall_async(tensor, splits, name=name).wait()
