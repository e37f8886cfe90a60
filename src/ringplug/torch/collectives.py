"""ringplug's collectives on torch tensors: the core's, with tensors in and tensors out.

CPU tensors reach the core without a copy: the core works on a numpy view of the tensor's
memory (bfloat16 as its raw 16-bit words). CUDA tensors go to the GPU data plane (NCCL) by
address, ordered after the work already queued on the caller's current stream; results
are ready for any stream when `wait()` returns. Non-contiguous tensors go through a
contiguous copy. The forms ending in ``_`` work in place; the ``_async`` forms return a handle whose
``wait()`` gives the tensor. Every rank must call the same collectives in the same order
(or under the same ``name``), as for the core.

Integer tensors take Average and scale factors as in `ringplug.tensorflow` and Horovod
(the core refuses them on plain buffers): the core sums, and each rank's values and the sum
are scaled in float64 and truncated toward zero.

The plain forms that return new tensors (`allreduce`, `grouped_allreduce`, `broadcast`,
`allgather`, `grouped_allgather`, `reducescatter`, `grouped_reducescatter`, `alltoall`) are
differentiable when an input requires grad. Their gradients are those of the sum of every
rank's loss: backward runs the matching collective on the ranks' gradients (an allreduce
for an allreduce, an allgather for a reducescatter, ...), so every rank must run backward
through them in the same order.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..core import Handle, runtime
from ..core import collectives as core
from ..core import device_collectives as device
from ..core.dtypes import DType
from ..core.gpu.device import DeviceBuffer
from ..core.kinds.base import at_once
from ..core.ops import Average, ReduceOp, Sum, as_op, integer_scaling

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
    """A collective on tensors in flight; `wait()` returns the tensor result.

    Args:
        handle: what is in flight: the core's `Handle`, another `TensorHandle`, or a list of
            them started together (done when all are; `wait()` waits for every one, even
            after one fails, so that none is left in flight, then raises the first error).
        finish: called with the result (a list of results for a list) once it has come;
            what it returns is what `wait()` returns.

    Example:
        >>> handle = ringplug.torch.allreduce_async(tensor, op="sum")  # doctest: +SKIP
        >>> doubled = ringplug.torch.TensorHandle(handle, lambda result: result * 2)
        >>> doubled.wait()
    """

    def __init__(self, handle: Handle | TensorHandle | list[Any], finish: Any) -> None:
        self._handle = handle
        self._finish = finish

    def done(self) -> bool:
        """Whether the result has come (never blocks)."""
        parts = self._handle if isinstance(self._handle, list) else [self._handle]
        return all(part.done() for part in parts)

    def wait(self, timeout: float | None = None) -> Any:
        """The result, once it has come (at most `timeout` seconds for all of it)."""
        if not isinstance(self._handle, list):
            return self._finish(self._handle.wait(timeout))
        deadline = None if timeout is None else time.monotonic() + timeout
        results, error = [], None
        for part in self._handle:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(part.wait(left))
            except Exception as exc:  # noqa: BLE001 - raised once every part has ended
                error = error or exc
        if error is not None:
            raise error
        return self._finish(results)

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
    if tensor.is_sparse:
        core.reject(
            TypeError(
                f"{what} takes dense tensors; reduce a sparse one with allreduce or "
                "allreduce_async (into a new tensor), or make it dense first (.to_dense())."
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


# What `_plain_array` takes: the floating types numpy has (bfloat16 is read from its raw
# words, and integers are scaled here: both go the usual way).
_PLAIN = frozenset({torch.float32, torch.float64, torch.float16})
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain_array(tensor: Any) -> np.ndarray | None:
    """A numpy view of `tensor` when a synchronous allreduce can hand it to the core's own
    synchronous call as it is (one layer, as `ringplug.allreduce` on an array: this module's
    checks, conversions and handle cost a small call a third of its time): a dense,
    contiguous CPU tensor of a type in `_PLAIN`; else None, and the usual path checks it."""
    if (
        type(tensor) in _PLAIN_TYPES
        and tensor.dtype in _PLAIN
        and tensor.is_cpu
        and not tensor.is_sparse
        and tensor.is_contiguous()
    ):
        return tensor.detach().numpy()
    return None


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
    """Start an allreduce of `tensor` into a new tensor (the input is not changed).

    A sparse COO `tensor` (Sum or Average) is reduced by gathering every rank's indices
    and values (named ``<name>.indices`` and ``<name>.values``), as ringplug.tensorflow
    reduces ``tf.IndexedSlices``: the result is uncoalesced (``coalesce()`` sums the
    duplicates).
    """
    if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
        return _sparse_allreduce(tensor, op, name, prescale_factor * postscale_factor)
    _check(tensor, "allreduce", name)
    result = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _allreduce_into(result, op, name, prescale_factor, postscale_factor, lambda: result)


def _sparse_allreduce(tensor: torch.Tensor, op: Any, name: str | None, factor: float) -> Any:
    try:
        reduce_op = as_op(op)
    except ValueError as exc:
        core.reject(exc, name)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        core.reject(ValueError(f"a sparse allreduce sums or averages, not {reduce_op.name}."), name)
    sparse = tensor.detach().coalesce()
    if reduce_op is ReduceOp.AVERAGE:
        factor /= runtime.size()
    # The gathered indices' rows are the nonzeros: gather them transposed.
    parts = [
        allgather_async(sparse.indices().t().contiguous(), name=_member(name, "indices")),
        allgather_async(sparse.values().contiguous(), name=_member(name, "values")),
    ]

    def finish(gathered: list[torch.Tensor]) -> torch.Tensor:
        indices, values = gathered
        values = values * factor if factor != 1.0 else values
        return torch.sparse_coo_tensor(indices.t(), values, tensor.shape, check_invariants=True)

    return TensorHandle(parts, finish)


def _member(name: str | None, part: str) -> str | None:
    """The name of one part of a request named `name`: ``<name>.<part>`` (unnamed when the
    request is)."""
    return None if name is None else f"{name}.{part}"


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
    op, prescale, postscale, after = _scaled_here([work], op, prescale, postscale)

    def done(_: Any) -> Any:
        if after is not None:
            _truncated(work, after)
        return finish()

    if work.is_cuda:
        return _device_allreduce([work], op, name, prescale, postscale, done)
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
    return TensorHandle(handle, done)


_INTEGERS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _integer_factor(tensor: Any, op: Any, prescale: float, postscale: float) -> float | None:
    """For an integer `tensor`, the factor its sum takes afterwards when it is scaled here
    (see `ringplug.core.ops.integer_scaling`), else None."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _INTEGERS:
        return None
    try:
        reduce_op = as_op(op)
    except ValueError:
        return None  # the core refuses it, on every rank
    return integer_scaling(reduce_op, prescale, postscale, runtime.size())


def _scaled_here(works: list[torch.Tensor], op: Any, prescale: float, postscale: float) -> tuple:
    """(op, prescale, postscale, factor after) for the core. Integers with Average or scale
    factors are summed by the core and scaled here, as ringplug.tensorflow and Horovod do:
    `works` (this rank's, to be reduced in place) by `prescale` now, the sum by the factor
    after; that factor is None where the core scales."""
    after = _integer_factor(works[0], op, prescale, postscale)
    if after is None:
        return op, prescale, postscale, None
    for work in works:
        _truncated(work, prescale)
    return Sum, 1.0, 1.0, after


def _truncated(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """`tensor` times `factor` in place, in float64 and truncated toward zero."""
    if factor != 1.0:
        with torch.no_grad():
            tensor.copy_(tensor.to(torch.float64).mul_(factor))
    return tensor


def allreduce(
    tensor: torch.Tensor,
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """The elementwise reduction of `tensor` over every rank, as a new tensor.

    Differentiable: the gradient is the ranks' gradients reduced the same way (op and
    scale factors).
    """
    scales = (prescale_factor, postscale_factor)
    if _tracks_grad([tensor]):
        return _Allreduce.apply(False, as_op(op), name, scales, tensor)[0]
    array = _plain_array(tensor)
    if array is not None:
        reduced = core.allreduce(
            array, op, name=name, prescale_factor=scales[0], postscale_factor=scales[1]
        )
        return torch.from_numpy(reduced)
    return _reduce_copies([tensor], False, op, name, scales)[0]


def allreduce_(tensor: torch.Tensor, op: ReduceOp | str = Average, **kwargs: Any) -> torch.Tensor:
    """Reduce `tensor` over every rank in place; returns `tensor`."""
    array = _plain_array(tensor)
    if array is not None:
        core.allreduce(array, op, out=array, **kwargs)
        return tensor
    return at_once(lambda: allreduce_async_(tensor, op, **kwargs))


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
    on_gpu = _on_gpu(tensors, "grouped_allreduce_", name)
    works = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in tensors]
    op, prescale, postscale, after = _scaled_here(works, op, prescale_factor, postscale_factor)

    def write_back(_: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            for tensor, work in zip(tensors, works, strict=True):
                if after is not None:
                    _truncated(work, after)
                if work.data_ptr() != tensor.data_ptr():
                    tensor.copy_(work)
        return tensors

    if on_gpu:
        return _device_allreduce(works, op, name, prescale, postscale, write_back)
    arrays = [as_numpy(work)[0] for work in works]
    handle = core.grouped_allreduce_async(
        arrays,
        op,
        out=arrays,
        name=name,
        dtype=as_numpy(works[0])[1],
        prescale_factor=prescale,
        postscale_factor=postscale,
    )
    return TensorHandle(handle, write_back)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start one allreduce of several tensors of one dtype into new tensors (the inputs are
    not changed); `wait()` returns the list."""
    scales = {"prescale_factor": prescale_factor, "postscale_factor": postscale_factor}
    return grouped_allreduce_async_([_copy(t) for t in tensors], op, name=name, **scales)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor], op: ReduceOp | str = Average, **kwargs: Any
) -> list[torch.Tensor]:
    """Reduce several tensors of one dtype in place, negotiated and fused as one."""
    return at_once(lambda: grouped_allreduce_async_(tensors, op, **kwargs))


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """The reductions of several tensors of one dtype, as new tensors (inputs unchanged);
    differentiable, as `allreduce`."""
    tensors, scales = list(tensors), (prescale_factor, postscale_factor)
    if _tracks_grad(tensors):
        return list(_Allreduce.apply(True, as_op(op), name, scales, *tensors))
    return _reduce_copies(tensors, True, op, name, scales)


def _reduce_copies(
    tensors: list[torch.Tensor], grouped: bool, op: Any, name: str | None, scales: tuple
) -> list[torch.Tensor]:
    """The reductions of copies of `tensors`: one grouped request, or one tensor's."""
    kwargs = {"name": name, "prescale_factor": scales[0], "postscale_factor": scales[1]}
    if grouped:
        return at_once(lambda: grouped_allreduce_async(tensors, op, **kwargs))
    return [at_once(lambda: allreduce_async(tensors[0], op, **kwargs))]


def _copy(tensor: Any) -> Any:
    """A contiguous copy of a tensor, off the graph (anything else as it is, for `_check`)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _tracks_grad(tensors: Sequence[Any]) -> bool:
    """Whether a collective of `tensors` is on autograd's graph."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def _remembers_scope(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A collective's forward that remembers the engine it ran on (a process set's, inside
    its scope), so that its backward runs on the same ranks."""

    @functools.wraps(forward)
    def run(ctx: Any, *args: Any) -> Any:
        ctx.ringplug_scope = runtime.scope.get()
        return forward(ctx, *args)

    return run


def _in_forward_scope(backward: Callable[..., Any]) -> Callable[..., Any]:
    """A collective's backward, run on the engine its forward ran on (autograd calls it
    outside the forward's scope)."""

    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> Any:
        token = runtime.scope.set(getattr(ctx, "ringplug_scope", None))
        try:
            return backward(ctx, *grads)
        finally:
            runtime.scope.reset(token)

    return run


class _Allreduce(torch.autograd.Function):
    """allreduce and grouped_allreduce, whose gradients are reduced the same way."""

    @staticmethod
    @_remembers_scope
    def forward(ctx: Any, grouped: bool, op: ReduceOp, name: Any, scales: tuple, *tensors: Any):
        ctx.grouped, ctx.op, ctx.scales = grouped, op, scales
        return tuple(_reduce_copies(list(tensors), grouped, op, name, scales))

    @staticmethod
    @_in_forward_scope
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = _reduce_copies(list(grads), ctx.grouped, ctx.op, None, ctx.scales)
        return (None, None, None, None, *reduced)


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


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int = 0,
    *,
    name: str | None = None,
    refuse_joined: bool = False,
) -> TensorHandle:
    """Start a broadcast of root's `tensor` into a new tensor (the input is not changed)."""
    return broadcast_async_(_copy(tensor), root_rank, name=name, refuse_joined=refuse_joined)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int = 0,
    *,
    name: str | None = None,
    refuse_joined: bool = False,
) -> torch.Tensor:
    """Overwrite `tensor` with root's on every rank; returns `tensor`."""
    return at_once(
        lambda: broadcast_async_(tensor, root_rank, name=name, refuse_joined=refuse_joined)
    )


def broadcast(
    tensor: torch.Tensor,
    root_rank: int = 0,
    *,
    name: str | None = None,
    refuse_joined: bool = False,
) -> torch.Tensor:
    """Root's `tensor`, as a new tensor on every rank.

    Differentiable: root's tensor gets the sum of every rank's gradient, the other ranks'
    tensors a zero gradient.
    """
    if _tracks_grad([tensor]):
        return _Broadcast.apply(tensor, root_rank, name, refuse_joined)
    return at_once(
        lambda: broadcast_async(tensor, root_rank, name=name, refuse_joined=refuse_joined)
    )


class _Broadcast(torch.autograd.Function):
    @staticmethod
    @_remembers_scope
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, refuse: bool) -> Any:
        ctx.root_rank = root_rank
        return at_once(lambda: broadcast_async(tensor, root_rank, name=name, refuse_joined=refuse))

    @staticmethod
    @_in_forward_scope
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        summed = at_once(lambda: allreduce_async(grad, "sum"))
        return (
            (summed if runtime.rank() == ctx.root_rank else torch.zeros_like(summed)),
            None,
            None,
            None,
        )


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


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], *, name: str | None = None, refuse_joined: bool = False
) -> TensorHandle:
    """Start an allgather of each of several tensors (named ``<name>.<i>``), together;
    `wait()` returns the list of gathered tensors (no autograd)."""
    parts = [
        allgather_async(t, name=n, refuse_joined=refuse_joined)
        for t, n in zip(tensors, _member_names(name, len(tensors)), strict=True)
    ]
    return TensorHandle(parts, list)


def _member_names(name: str | None, count: int) -> list[str | None]:
    """The names of a group's members: ``<name>.<i>`` (unnamed when the group is)."""
    return [_member(name, str(i)) for i in range(count)]


class _Allgather(torch.autograd.Function):
    """(grouped) allgather whose backward sums every rank's gradient for this rank's rows."""

    @staticmethod
    @_remembers_scope
    def forward(ctx: Any, name: Any, refuse: bool, *tensors: torch.Tensor) -> Any:
        rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        counts = core.allgather_object(rows, name=None if name is None else f"{name}.rows")
        ctx.offsets = [sum(c[i] for c in counts[: runtime.rank()]) for i in range(len(rows))]
        ctx.rows, ctx.scalars = rows, [t.dim() == 0 for t in tensors]
        names = [name] if len(tensors) == 1 else _member_names(name, len(tensors))
        parts = zip(tensors, names, strict=True)
        handles = [allgather_async(t, name=n, refuse_joined=refuse) for t, n in parts]
        return tuple(TensorHandle(handles, list).wait())

    @staticmethod
    @_in_forward_scope
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        summed = TensorHandle([allreduce_async(g, "sum") for g in grads], list).wait()
        places = zip(summed, ctx.offsets, ctx.rows, ctx.scalars, strict=True)
        mine = [
            s.narrow(0, offset, rows).reshape(()) if scalar else s.narrow(0, offset, rows)
            for s, offset, rows, scalar in places
        ]
        return (None, None, *mine)


def allgather(
    tensor: torch.Tensor, *, name: str | None = None, refuse_joined: bool = False
) -> torch.Tensor:
    """Every rank's `tensor` concatenated on the first dimension (which may differ).

    Differentiable when `tensor` requires grad: the gradient of each rank's rows is the sum
    of every rank's gradient for them (what Lightning's ``all_gather(sync_grads=True)``
    expects).
    """
    if _tracks_grad([tensor]):
        return _Allgather.apply(name, refuse_joined, tensor)[0]
    return at_once(lambda: allgather_async(tensor, name=name, refuse_joined=refuse_joined))


def grouped_allgather(
    tensors: Sequence[torch.Tensor], *, name: str | None = None, refuse_joined: bool = False
) -> list[torch.Tensor]:
    """`allgather` of each of several tensors, started together; differentiable, as
    `allgather`."""
    tensors = list(tensors)
    if _tracks_grad(tensors):
        return list(_Allgather.apply(name, refuse_joined, *tensors))
    return grouped_allgather_async(tensors, name=name, refuse_joined=refuse_joined).wait()


def reducescatter_async(
    tensor: torch.Tensor,
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start a reducescatter; `wait()` returns this rank's block of rows of the reduction
    (earlier ranks get a row more when the rows do not divide)."""
    _check(tensor, "reducescatter", name)
    work = tensor.detach().contiguous()
    after = _integer_factor(tensor, op, prescale_factor, postscale_factor)
    if after is not None:  # scaled here, as `allreduce` does
        work = _truncated(_copy(work), prescale_factor)
        handle = reducescatter_async(work, Sum, name=name)
        return TensorHandle(handle, lambda block: _truncated(block, after))
    scales = {"prescale_factor": prescale_factor, "postscale_factor": postscale_factor}
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
            device_buffer(work), tuple(work.shape), op, name=name, ready=_ready(work), **scales
        )
        return TensorHandle(handle, finish)
    array, dtype = as_numpy(work)
    handle = core.reducescatter_async(array, op, name=name, dtype=dtype, **scales)
    return TensorHandle(handle, lambda block: from_numpy(block, tensor))


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start a reducescatter of each of several tensors (named ``<name>.<i>``), together;
    `wait()` returns this rank's blocks (no autograd)."""
    scales = (prescale_factor, postscale_factor)
    return _reducescatters(list(tensors), _member_names(name, len(tensors)), op, scales)


def _reducescatters(tensors: list, names: list, op: Any, scales: tuple) -> TensorHandle:
    parts = [
        reducescatter_async(t, op, name=n, prescale_factor=scales[0], postscale_factor=scales[1])
        for t, n in zip(tensors, names, strict=True)
    ]
    return TensorHandle(parts, list)


class _Reducescatter(torch.autograd.Function):
    """(grouped) reducescatter, whose backward gathers the blocks' gradients back."""

    @staticmethod
    @_remembers_scope
    def forward(ctx: Any, op: ReduceOp, names: list, scales: tuple, *tensors: Any) -> Any:
        if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise ValueError(f"reducescatter has a gradient for Sum and Average, not {op.name}.")
        ctx.factor = scales[0] * scales[1] / (runtime.size() if op is Average else 1)
        return tuple(_reducescatters(list(tensors), names, op, scales).wait())

    @staticmethod
    @_in_forward_scope
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        # Every rank's input reached every block, scaled by the op and the factors.
        gathered = TensorHandle([allgather_async(g) for g in grads], list).wait()
        return (None, None, None, *(g * ctx.factor if ctx.factor != 1 else g for g in gathered))


def reducescatter(
    tensor: torch.Tensor,
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's block of rows of the reduction of `tensor` over every rank.

    Differentiable (Sum and Average): every rank's block's gradient, gathered back to each
    rank's input and scaled as the reduction scaled it.
    """
    scales = (prescale_factor, postscale_factor)
    if _tracks_grad([tensor]):
        return _Reducescatter.apply(as_op(op), [name], scales, tensor)[0]
    return at_once(lambda: _reducescatters([tensor], [name], op, scales))[0]


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """`reducescatter` of each of several tensors, started together; differentiable, as
    `reducescatter`."""
    tensors, scales = list(tensors), (prescale_factor, postscale_factor)
    names = _member_names(name, len(tensors))
    if _tracks_grad(tensors):
        return list(_Reducescatter.apply(as_op(op), names, scales, *tensors))
    return _reducescatters(tensors, names, op, scales).wait()


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    *,
    name: str | None = None,
) -> TensorHandle:
    """Start an alltoall; `wait()` returns the rows received and their counts per rank."""
    _check(tensor, "alltoall", name)
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype is torch.bool:
            core.reject(
                ValueError(f"alltoall splits must be integers (torch.int32), got {splits.dtype}."),
                name,
            )
        splits = splits.tolist()
    host = tensor.detach().cpu() if tensor.is_cuda else tensor.detach()
    array, dtype = as_numpy(host.contiguous())

    def finish(result: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        received, counts = result
        return from_numpy(received, tensor).to(tensor.device), torch.from_numpy(counts)

    return TensorHandle(core.alltoall_async(array, splits, name=name, dtype=dtype), finish)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    @_remembers_scope
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any) -> Any:
        received, counts = at_once(lambda: alltoall_async(tensor, splits, name=name))
        ctx.counts = counts
        ctx.mark_non_differentiable(counts)
        return received, counts

    @staticmethod
    @_in_forward_scope
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, None, None]:
        # Each row's gradient goes back to the rank it came from.
        return at_once(lambda: alltoall_async(grad, ctx.counts))[0], None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    *,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send rows `splits[i]` of `tensor` to rank i (an even split without `splits`); returns
    the rows received, in rank order, and their counts from each rank.

    Differentiable: each row's gradient goes back to the rank it came from. CUDA tensors
    travel through host memory (NCCL has no alltoall with per-rank splits).
    """
    if _tracks_grad([tensor]):
        return _Alltoall.apply(tensor, splits, name)
    return at_once(lambda: alltoall_async(tensor, splits, name=name))
