"""Horovod's ``horovod.tensorflow`` API on ringplug: ``import ringplug.horovod.tensorflow as
hvd``.

The collectives take and return TensorFlow tensors in every mode TensorFlow has:

- eagerly, they run at once (ringplug's core on the tensors' memory);
- inside a ``tf.function`` or a TF1 graph they become graph ops (a stateful
  ``tf.numpy_function``), so a function compiles them into its step, they keep program
  order there (stateful ops are ordered), and they run each time the step runs. In a
  graph, each op is named after the graph's own unique op name, identical on every rank
  that builds the same graph, so the ranks match them by name in whatever order a
  session runs them.

Every collective is differentiable as in Horovod (allreduce's gradient is reduced the
same way, allgather's is this rank's rows of the averaged gradient, broadcast's is the
averaged gradient on the root and zero elsewhere, alltoall's sends the rows back).
`tf.IndexedSlices` are allreduced as Horovod does, by gathering values and indices.

Failures: a collective that does not match across ranks raises
``tf.errors.FailedPreconditionError`` with ringplug's message, eagerly and inside graphs
alike, as Horovod's ops do (in a graph through a check op after the collective's
``numpy_function``, see `_status`); arguments the collective rejects raise
``InvalidArgumentError``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

# In a TF1 graph each collective op holds one of the session's inter-op threads while it
# waits for the other ranks (Horovod's own ops are asynchronous kernels and hold none).
# With the default of one thread per core, a session.run with more concurrent collectives
# than cores can leave every thread of each rank waiting on ops the other rank has not
# reached. Read when the first session starts its thread pool; a user's setting wins.
os.environ.setdefault("TF_NUM_INTEROP_THREADS", str(max(64, os.cpu_count() or 1)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from ... import core
from ...core import collectives as _core
from ...core.errors import RingplugError
from ...core.ops import ReduceOp
from .._common import *  # noqa: F403 - Horovod's basics, re-exported
from .._common import (  # noqa: F401 - Sum: hvd.Sum
    Average,
    Sum,
    allgather_object,
    backend_variable,
    broadcast_object,
    check_process_set,
    global_process_set,
    local_layers_variables,
    resolve_op,
)
from .._common import __all__ as _BASICS
from . import _status, util
from .util import _executing_eagerly  # noqa: F401 - hvd._executing_eagerly, as Horovod


class _NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class _FP16Compressor:
    """Sends floating tensors as float16."""

    is_fp16 = True

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = tensor.dtype
        if dtype.is_floating:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tf.cast(tensor, ctx) if ctx is not None and ctx.is_floating else tensor


class Compression:
    """``hvd.Compression.none`` / ``hvd.Compression.fp16``."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


# ---------------------------------------------------------------------------- machinery
def _op_name(kind: str, name: str | None) -> str | None:
    """The collective's name: the caller's, else none eagerly (ringplug numbers unnamed
    calls), else the graph's unique op name (the same on every rank building this graph)."""
    if name is not None:
        return re.sub(r"[^A-Za-z0-9_./-]", "_", str(name))
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph().unique_name(f"Horovod{kind}")


# Unsigned types the core does not reduce travel as the signed type of their width in the
# collectives that only move data (allgather, broadcast, alltoall): the bits are the same.
_MOVED_AS = {
    np.dtype(np.uint16): np.dtype(np.int16),
    np.dtype(np.uint32): np.dtype(np.int32),
    np.dtype(np.uint64): np.dtype(np.int64),
}


def _storage(array: np.ndarray, moved: bool = False) -> tuple[np.ndarray, str | None]:
    """A contiguous array the core reads, and the dtype to read it as (bfloat16 by its
    raw 16-bit words; with `moved`, unsigned types by their signed twin's)."""
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return array.view(np.uint16), "bfloat16"
    if moved and array.dtype in _MOVED_AS:
        return array.view(_MOVED_AS[array.dtype]), None
    return array, None


def _restore(result: np.ndarray, like: np.ndarray) -> np.ndarray:
    if like.dtype.name == "bfloat16" or like.dtype in _MOVED_AS:
        return result.view(like.dtype)
    return result


def _failed(exc: BaseException) -> BaseException:
    """A ringplug failure as the TensorFlow error Horovod's ops raise."""
    if isinstance(exc, RingplugError):
        return tf.errors.FailedPreconditionError(None, None, str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        return tf.errors.InvalidArgumentError(None, None, str(exc))
    return exc


def _run(
    kind: str,
    compute: Callable[..., list[np.ndarray]],
    inputs: Sequence[Any],
    touts: Sequence[tf.DType],
    shapes: Sequence[Any],
    name: str | None,
) -> list[Any]:
    """Run `compute(name, *arrays) -> arrays` now (eagerly) or as a stateful graph op."""
    op_name = _op_name(kind, name)
    tensors = [tf.convert_to_tensor(t) for t in inputs]
    if tf.executing_eagerly():
        try:
            results = compute(op_name, *[t.numpy() for t in tensors])
        except (RingplugError, ValueError, TypeError) as exc:
            raise _failed(exc) from exc
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, touts, strict=True)]

    checked = _status.available()

    def graph_compute(*arrays: np.ndarray) -> list[np.ndarray]:
        if not checked:
            return [np.asarray(r) for r in compute(op_name, *arrays)]
        try:
            results = [np.asarray(r) for r in compute(op_name, *arrays)]
        except RingplugError as exc:
            # Raised here it would surface with py_func's codes (InvalidArgument, Unknown):
            # the check op after this one fails the step with FailedPrecondition, as
            # eagerly, and nothing reads these placeholders.
            placeholders = [np.zeros(0, dtype=d.as_numpy_dtype) for d in touts]
            return [*placeholders, np.int64(_status.file_failure(str(exc)))]
        return [*results, np.int64(0)]

    outputs = tf.numpy_function(
        graph_compute,
        tensors,
        [*touts, tf.int64] if checked else list(touts),
        stateful=True,
        name=f"ringplug_{kind.lower()}",
    )
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if checked:
        outputs = _status.gated(outputs[-1], outputs[:-1])
    for output, shape in zip(outputs, shapes, strict=True):
        output.set_shape(shape)
    return list(outputs)


def _integer(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.integer)


def _reduce_arrays(
    name: str | None, arrays: Sequence[np.ndarray], op: ReduceOp, pre: float, post: float
) -> list[np.ndarray]:
    """Allreduce several arrays (one request per dtype). Integers are scaled here as
    Horovod does: in float64, truncated toward zero, each rank's values by `pre` before
    the sum and the sum by `post` (and 1/size for Average) after it."""
    groups: dict[str, list[int]] = {}
    for index, array in enumerate(arrays):
        groups.setdefault(str(array.dtype), []).append(index)
    results: list[np.ndarray] = [np.empty(0)] * len(arrays)
    handles = []
    for dtype, indices in groups.items():
        members = [_storage(arrays[i]) for i in indices]
        core_op, core_pre, core_post, after = op, pre, post, 1.0
        if (
            _integer(arrays[indices[0]].dtype)
            and (op is ReduceOp.AVERAGE or pre != 1.0 or post != 1.0)
            and op in (ReduceOp.AVERAGE, ReduceOp.SUM)
        ):
            core_op, core_pre, core_post = ReduceOp.SUM, 1.0, 1.0
            after = post / core.size() if op is ReduceOp.AVERAGE else post
            members = [((m * pre).astype(m.dtype) if pre != 1.0 else m, d) for m, d in members]
        request = name if len(groups) == 1 or name is None else f"{name}.{dtype}"
        handle = _core.grouped_allreduce_async(
            [m for m, _ in members],
            core_op,
            name=request,
            dtype=members[0][1],
            prescale_factor=core_pre,
            postscale_factor=core_post,
        )
        handles.append((indices, handle, after))
    error = None
    for indices, handle, after in handles:
        try:
            reduced = handle.wait()
        except Exception as exc:  # noqa: BLE001 - every handle is waited for, then raised
            error = error or exc
            continue
        for index, result in zip(indices, reduced, strict=True):
            result = _restore(np.asarray(result), arrays[index]).reshape(arrays[index].shape)
            if after != 1.0:
                result = (result.astype(np.float64) * after).astype(arrays[index].dtype)
            results[index] = result
    if error is not None:
        raise error
    return results


def _dense(tensor: Any) -> Any:
    return tf.convert_to_tensor(tensor)


def _differentiable(
    forward: Callable[..., list[Any]],
    backward: Callable[[list[Any], list[Any], list[Any]], list[Any]],
    values: list[Any],
) -> list[Any]:
    """`forward(*values)` (a list of outputs), whose gradient is `backward(upstream,
    inputs, outputs)` (one per input). Outputs nothing flowed back to get zeros, as
    Horovod's gradients do. Without a floating input there is no gradient to define."""
    if not any(v.dtype.is_floating for v in values):
        return forward(*values)

    @tf.custom_gradient
    def collective(*inputs: Any) -> Any:
        outputs = forward(*inputs)

        def grad(*upstream: Any) -> Any:
            upstream = [
                tf.zeros_like(o) if u is None else u for u, o in zip(upstream, outputs, strict=True)
            ]
            back = backward(upstream, list(inputs), outputs)
            return back if len(back) > 1 else back[0]

        return (outputs if len(outputs) > 1 else outputs[0]), grad

    result = collective(*values)
    return list(result) if isinstance(result, (list, tuple)) else [result]


# ---------------------------------------------------------------------------- allreduce
def _allreduce_dense(
    tensors: list[Any],
    op: ReduceOp,
    pre: float,
    post: float,
    name: str | None,
    kind: str = "Allreduce",
) -> list[Any]:
    """Differentiable allreduce of dense tensors as one request (the gradient is reduced
    the same way, unnamed: it runs where the backward pass reaches it)."""

    def reduce(values: Sequence[Any], request: str | None) -> list[Any]:
        return _run(
            kind,
            lambda n, *a: _reduce_arrays(n, a, op, pre, post),
            values,
            [v.dtype for v in values],
            [v.shape for v in values],
            request,
        )

    return _differentiable(
        lambda *values: reduce(values, name),
        lambda upstream, inputs, outputs: reduce(upstream, None),
        [_dense(t) for t in tensors],
    )


def _sparse_allreduce(
    slices: tf.IndexedSlices, op: ReduceOp, pre: float, post: float, name: str | None
) -> tf.IndexedSlices:
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices.")
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices.")
    values = allgather(slices.values, name=None if name is None else f"{name}.values")
    indices = allgather(slices.indices, name=None if name is None else f"{name}.indices")
    if op is ReduceOp.AVERAGE:
        values = values / tf.cast(core.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: Any = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """The reduction of `tensor` (a tensor, variable or ``tf.IndexedSlices``) over every
    rank; Average when no op is given. Differentiable."""
    check_process_set(process_set)
    reduce_op = resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, reduce_op, prescale_factor, postscale_factor, name)
    compressed, ctx = compression.compress(_dense(tensor))
    (reduced,) = _allreduce_dense([compressed], reduce_op, prescale_factor, postscale_factor, name)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
    name: str | None = None,
    ignore_name_scope: bool = False,
) -> list[Any]:
    """Several tensors reduced together (dense ones as one request per dtype;
    ``tf.IndexedSlices`` gathered); returns them in order. Differentiable."""
    check_process_set(process_set)
    reduce_op = resolve_op(average, op)
    tensors = list(tensors)
    if not tensors:
        return []
    results: list[Any] = [None] * len(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = _sparse_allreduce(
                t,
                reduce_op,
                prescale_factor,
                postscale_factor,
                None if name is None else f"{name}.{i}",
            )
    if dense:
        packed = [compression.compress(_dense(tensors[i])) for i in dense]
        reduced = _allreduce_dense(
            [c for c, _ in packed],
            reduce_op,
            prescale_factor,
            postscale_factor,
            name,
            "GroupedAllreduce",
        )
        for i, r, (_, ctx) in zip(dense, reduced, packed, strict=True):
            results[i] = compression.decompress(r, ctx)
    return results


# ---------------------------------------------------------------------------- allgather
def _gather_arrays(name: str | None, *arrays: np.ndarray) -> list[np.ndarray]:
    handles = []
    for index, array in enumerate(arrays):
        work, dtype = _storage(array, moved=True)
        part = name if name is None or len(arrays) == 1 else f"{name}.{index}"
        handles.append(_core.allgather_async(work, name=part, dtype=dtype, refuse_joined=True))
    results, error = [], None
    for handle, array in zip(handles, arrays, strict=True):
        try:
            results.append(_restore(np.asarray(handle.wait()), array))
        except Exception as exc:  # noqa: BLE001 - every handle is waited for, then raised
            error = error or exc
    if error is not None:
        raise error
    return results


def _rows_of(grad: Any, value: Any) -> Any:
    """This rank's rows of a gathered gradient (row counts gathered now)."""
    rows = tf.shape(value, out_type=tf.int64)[:1]
    counts = _run("Allgather", _gather_arrays, [rows], [tf.int64], [[None]], None)[0]
    offset = tf.reduce_sum(counts[: core.rank()])
    begin = tf.concat([[offset], tf.zeros([tf.rank(value) - 1], tf.int64)], 0)
    size = tf.concat([rows, tf.fill([tf.rank(value) - 1], tf.constant(-1, tf.int64))], 0)
    return tf.slice(grad, begin, size)


def _allgather_many(tensors: list[Any], name: str | None, kind: str) -> list[Any]:
    values = [_dense(t) for t in tensors]
    shapes = [
        tf.TensorShape([None]).concatenate(v.shape[1:]) if v.shape.rank else tf.TensorShape([None])
        for v in values
    ]

    def gather(*inputs: Any) -> list[Any]:
        return _run(kind, _gather_arrays, inputs, [v.dtype for v in inputs], shapes, name)

    def grad(upstream: list[Any], inputs: list[Any], outputs: list[Any]) -> list[Any]:
        averaged = _allreduce_dense(upstream, ReduceOp.AVERAGE, 1.0, 1.0, None)
        return [_rows_of(a, v) for a, v in zip(averaged, inputs, strict=True)]

    return _differentiable(gather, grad, values)


def allgather(
    tensor: Any,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """Every rank's `tensor` concatenated on the first dimension (which may differ).
    Differentiable: each rank's rows get the average of the ranks' gradients for them."""
    check_process_set(process_set)
    return _allgather_many([tensor], name, "Allgather")[0]


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> list[Any]:
    """`allgather` of several tensors together; returns them in order."""
    check_process_set(process_set)
    tensors = list(tensors)
    return _allgather_many(tensors, name, "GroupedAllgather") if tensors else []


# ---------------------------------------------------------------------------- broadcast
def _broadcast_arrays(root_rank: int) -> Callable[..., list[np.ndarray]]:
    def compute(name: str | None, *arrays: np.ndarray) -> list[np.ndarray]:
        handles = []
        for index, array in enumerate(arrays):
            work, dtype = _storage(np.array(array, copy=True), moved=True)
            part = name if name is None or len(arrays) == 1 else f"{name}.{index}"
            handles.append(
                (
                    work,
                    _core.broadcast_async(
                        work, root_rank, out=work, name=part, dtype=dtype, refuse_joined=True
                    ),
                )
            )
        results, error = [], None
        for (work, handle), array in zip(handles, arrays, strict=True):
            try:
                handle.wait()
                results.append(_restore(work, array).reshape(np.shape(array)))
            except Exception as exc:  # noqa: BLE001 - every handle is waited for, then raised
                error = error or exc
        if error is not None:
            raise error
        return results

    return compute


def _broadcast_many(tensors: list[Any], root_rank: int, name: str | None) -> list[Any]:
    values = [_dense(t) for t in tensors]
    compute = _broadcast_arrays(root_rank)

    def run(*inputs: Any) -> list[Any]:
        return _run(
            "Broadcast", compute, inputs, [v.dtype for v in inputs], [v.shape for v in inputs], name
        )

    def grad(upstream: list[Any], inputs: list[Any], outputs: list[Any]) -> list[Any]:
        # Every rank takes part in the reduction; only the root's input had an effect.
        averaged = _allreduce_dense(upstream, ReduceOp.AVERAGE, 1.0, 1.0, None)
        return averaged if core.rank() == root_rank else [a * 0 for a in averaged]

    return _differentiable(run, grad, values)


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """Root's `tensor` on every rank (differentiable: the averaged gradient on the root,
    zero elsewhere)."""
    check_process_set(process_set)
    return _broadcast_many([tensor], root_rank, name)[0]


def broadcast_(
    variables: Sequence[Any],
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> list[Any]:
    """Assign root's values to `variables` in place; returns their new values."""
    check_process_set(process_set)
    variables = list(variables)
    values = _broadcast_many(
        [v.read_value() if hasattr(v, "read_value") else v for v in variables], root_rank, name
    )
    return [variable.assign(value) for variable, value in zip(variables, values, strict=True)]


def broadcast_variables(
    variables: Sequence[Any],
    root_rank: int,
    process_set: Any = global_process_set,
    inplace: bool = False,
) -> Any:
    """Assign root's values to `variables` on every rank (eagerly at once; in a graph, the
    returned op does it)."""
    check_process_set(process_set)
    variables = list(variables)
    if not variables:
        return tf.no_op() if not tf.executing_eagerly() else None
    assigned = broadcast_(variables, root_rank)
    if tf.executing_eagerly():
        return None
    return tf.group(*assigned)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graphs: an op assigning root's values to every global variable."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not work eagerly (there are no global "
            "variables); use hvd.broadcast_variables(model.variables, root_rank=0)."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


# ---------------------------------------------------------------------------- alltoall
def _alltoall_arrays(name: str | None, array: np.ndarray, splits: np.ndarray) -> list[np.ndarray]:
    work, dtype = _storage(array, moved=True)
    if splits.size == 0:
        splits = None
    elif not _integer(splits.dtype):
        raise ValueError(f"alltoall splits must be integers, got {splits.dtype}.")
    received, counts = _core.alltoall(work, splits, name=name, dtype=dtype)
    return [_restore(np.asarray(received), array), np.asarray(counts, np.int32)]


def _alltoall_raw(value: Any, splits: Any, name: str | None) -> list[Any]:
    shape = tf.TensorShape([None]).concatenate(value.shape[1:]) if value.shape.rank else None
    return _run(
        "Alltoall",
        _alltoall_arrays,
        [value, splits],
        [value.dtype, tf.int32],
        [shape, [core.size()]],
        name,
    )


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = global_process_set,
) -> Any:
    """Rows ``splits[i]`` of `tensor` to rank i (an even split without `splits`).

    Returns the rows received, in rank order; with `splits`, a pair of them and the
    int32 counts received from each rank (as Horovod). Differentiable."""
    check_process_set(process_set)
    value = _dense(tensor)
    given = splits is not None
    split_tensor = tf.convert_to_tensor(splits) if given else tf.constant([], tf.int32)

    def grad(upstream: list[Any], inputs: list[Any], outputs: list[Any]) -> list[Any]:
        # The rows go back where they came from: each rank sends what it received.
        return [_alltoall_raw(upstream[0], outputs[1], None)[0]]

    received, counts = _differentiable(
        lambda x: _alltoall_raw(x, split_tensor, name), grad, [value]
    )
    return (received, counts) if given else received


# ---------------------------------------------------------------------------- reducescatter
def _scatter_arrays(op: ReduceOp, pre: float, post: float) -> Callable[..., list[np.ndarray]]:
    def compute(name: str | None, *arrays: np.ndarray) -> list[np.ndarray]:
        handles = []
        for index, array in enumerate(arrays):
            work, dtype = _storage(array)
            core_op, core_pre, core_post, after = op, pre, post, 1.0
            if (
                _integer(array.dtype)
                and op in (ReduceOp.AVERAGE, ReduceOp.SUM)
                and (op is ReduceOp.AVERAGE or pre != 1.0 or post != 1.0)
            ):
                core_op, core_pre, core_post = ReduceOp.SUM, 1.0, 1.0
                after = post / core.size() if op is ReduceOp.AVERAGE else post
                work = (work * pre).astype(work.dtype) if pre != 1.0 else work
            part = name if name is None or len(arrays) == 1 else f"{name}.{index}"
            handle = _core.reducescatter_async(
                work,
                core_op,
                name=part,
                dtype=dtype,
                prescale_factor=core_pre,
                postscale_factor=core_post,
            )
            handles.append((handle, after))
        results, error = [], None
        for (handle, after), array in zip(handles, arrays, strict=True):
            try:
                block = _restore(np.asarray(handle.wait()), array)
            except Exception as exc:  # noqa: BLE001 - every handle is waited for, then raised
                error = error or exc
                continue
            if after != 1.0:
                block = (block.astype(np.float64) * after).astype(array.dtype)
            results.append(block)
        if error is not None:
            raise error
        return results

    return compute


def _reducescatter_many(
    tensors: list[Any], op: ReduceOp, pre: float, post: float, name: str | None, kind: str
) -> list[Any]:
    values = [_dense(t) for t in tensors]
    for value in values:
        if value.shape.rank == 0:
            raise ValueError(
                "reducescatter needs a tensor with at least one dimension to split over the ranks."
            )
    shapes = [
        tf.TensorShape([None]).concatenate(v.shape[1:]) if v.shape.rank else None for v in values
    ]
    compute = _scatter_arrays(op, pre, post)

    def run(*inputs: Any) -> list[Any]:
        return _run(kind, compute, inputs, [v.dtype for v in inputs], shapes, name)

    def grad(upstream: list[Any], inputs: list[Any], outputs: list[Any]) -> list[Any]:
        factor = (core.size() if op is ReduceOp.SUM else 1.0) * pre * post
        scaled = [u * tf.cast(factor, u.dtype) if factor != 1.0 else u for u in upstream]
        return _run(
            kind, _gather_arrays, scaled, [s.dtype for s in scaled], [v.shape for v in inputs], None
        )

    return _differentiable(run, grad, values)


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    name: str | None = None,
    process_set: Any = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """This rank's block of rows of the reduction (earlier ranks get a row more when the
    rows do not divide). Differentiable."""
    check_process_set(process_set)
    compressed, ctx = compression.compress(_dense(tensor))
    (block,) = _reducescatter_many(
        [compressed], resolve_op(None, op), prescale_factor, postscale_factor, name, "Reducescatter"
    )
    return compression.decompress(block, ctx)


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: Any = global_process_set,
    name: str | None = None,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[Any]:
    """`reducescatter` of several tensors together; returns the blocks in order."""
    check_process_set(process_set)
    tensors = list(tensors)
    if not tensors:
        return []
    packed = [compression.compress(_dense(t)) for t in tensors]
    blocks = _reducescatter_many(
        [c for c, _ in packed],
        resolve_op(None, op),
        prescale_factor,
        postscale_factor,
        name,
        "GroupedReducescatter",
    )
    return [compression.decompress(b, ctx) for b, (_, ctx) in zip(blocks, packed, strict=True)]


# ---------------------------------------------------------------------------- the rest
def join() -> Any:
    """This rank has no more data: take part in the others' allreduces with zeros until
    every rank has joined; returns (a tensor of) the last rank to join."""
    result = _run("Join", lambda n: [np.asarray(core.join(), np.int32)], [], [tf.int32], [[]], None)
    return result[0]


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank has called barrier."""
    check_process_set(process_set)
    core.barrier()


def _constant_op(value: Callable[[], int], name: str | None) -> Any:
    return tf.constant(value(), dtype=tf.int32, name=name)


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """The number of ranks, as a tensor."""
    return _constant_op(core.size, name)


def local_size_op(name: str | None = None) -> Any:
    """The number of ranks on this host, as a tensor."""
    return _constant_op(core.local_size, name)


def rank_op(name: str | None = None) -> Any:
    """This rank, as a tensor."""
    return _constant_op(core.rank, name)


def local_rank_op(name: str | None = None) -> Any:
    """This rank's index on its host, as a tensor."""
    return _constant_op(core.local_rank, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """1: every rank is in the (only, global) process set."""
    check_process_set(None if process_set_id == 0 else process_set_id)
    return tf.constant(1, dtype=tf.int32, name=name)


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from root (Horovod's TF1 form)."""
    check_process_set(process_set)
    return lambda obj: core.broadcast_object(obj, root_rank, name=name)


# ---------------------------------------------------------------------------- gradients
def _reduce_gradients(
    grads: Sequence[Any], op: ReduceOp, compression: Any, sparse_as_dense: bool, predivide: float
) -> list[Any]:
    """`grads` (None for no gradient) averaged over every rank as one grouped request."""
    if core.size() == 1:
        return list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    values = [grads[i] for i in present]
    if sparse_as_dense:
        values = [tf.convert_to_tensor(v) if isinstance(v, tf.IndexedSlices) else v for v in values]
    pre, post = 1.0, 1.0
    if predivide != 1.0:
        if op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor only applies to op=Average.")
        pre, post = 1.0 / predivide, predivide
    reduced = grouped_allreduce(
        values, op=op, compression=compression, prescale_factor=pre, postscale_factor=post
    )
    out = list(grads)
    for index, value in zip(present, reduced, strict=True):
        out[index] = value
    return out


def _source_key(source: Any) -> Any:
    """A hashable identity for a variable (a Keras variable's is its TF variable's)."""
    source = backend_variable(source)
    return source.ref() if hasattr(source, "ref") else id(source)


class _DistributedGradientTape:
    """A GradientTape whose `gradient()` averages the gradients over every rank; those of
    local sources stay on this rank (divided by the number of ranks, as Horovod's
    ``scale_local_gradients`` does)."""

    def __init__(
        self,
        tape: tf.GradientTape,
        op: ReduceOp,
        compression: Any,
        sparse_as_dense: bool,
        predivide: float,
        local_variables: Sequence[Any] = (),
        scale_local_gradients: bool = True,
    ) -> None:
        self._tape = tape
        self._op = op
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._predivide = predivide
        self._local = {_source_key(v) for v in local_variables}
        self.scale_local_gradients = scale_local_gradients

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> _DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def register_local_source(self, source: Any) -> None:
        """Keep `source`'s gradient on this rank (not averaged)."""
        self._local.add(_source_key(source))

    def _is_local(self, source: Any) -> bool:
        return _source_key(source) in self._local

    def _scaled_local(self, grad: Any) -> Any:
        if grad is None or not self.scale_local_gradients or core.size() == 1:
            return grad
        factor = 1.0 / core.size()
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
        return grad * factor

    def gradient(
        self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any
    ) -> Any:
        """The tape's gradients, averaged over every rank (local sources' kept here)."""
        kwargs.pop("use_generic_names", None)
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        local = [self._is_local(s) for s in flat_sources]
        shared = [None if is_local else g for g, is_local in zip(flat, local, strict=True)]
        reduced = _reduce_gradients(
            shared, self._op, self._compression, self._sparse_as_dense, self._predivide
        )
        merged = [
            self._scaled_local(g) if is_local else r
            for g, r, is_local in zip(flat, reduced, local, strict=True)
        ]
        return tf.nest.pack_sequence_as(grads, merged)

    def get_local_and_global_gradients(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
    ) -> tuple[list, list]:
        """([(local source, its gradient)], [(other source, its averaged gradient)])."""
        grads = self.gradient(target, sources, output_gradients)
        local, shared = [], []
        for g, s in zip(tf.nest.flatten(grads), tf.nest.flatten(sources), strict=True):
            (local if self._is_local(s) else shared).append((s, g))
        return local, shared


def DistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Wrap `gradtape` so that ``gradient()`` returns gradients averaged over every rank
    (one grouped allreduce; ``tf.IndexedSlices`` gathered, or densified with
    `sparse_as_dense`). Works eagerly and inside ``tf.function``."""
    check_process_set(process_set)
    return _DistributedGradientTape(
        gradtape,
        resolve_op(None, op),
        compression,
        sparse_as_dense,
        float(gradient_predivide_factor),
        (),
        scale_local_gradients,
    )


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """`DistributedGradientTape` that leaves the gradients of `local_layers`' variables
    local (model parallelism: each rank trains its own copy of those layers)."""
    check_process_set(process_set)
    local = local_layers_variables(local_layers)
    return _DistributedGradientTape(
        gradtape,
        resolve_op(None, op),
        compression,
        sparse_as_dense,
        float(gradient_predivide_factor),
        local,
        scale_local_gradients,
    )


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = global_process_set,
) -> Any:
    """A Keras optimizer averaging its gradients over every rank (``ringplug.keras``'s
    DistributedOptimizer); ``tf.compat.v1.train`` optimizers are refused."""
    check_process_set(process_set)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise NotImplementedError(
            "ringplug.horovod.tensorflow wraps Keras optimizers only; for a "
            "tf.compat.v1.train optimizer, reduce the gradients with "
            "hvd.grouped_allreduce(grads) between compute_gradients() and "
            "apply_gradients(), or move to Keras (tf.keras.optimizers)."
        )
    from ..keras import DistributedOptimizer as _keras_optimizer

    return _keras_optimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
    )


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """When the session is created, every rank's global variables get root's values (for
    ``tf.compat.v1.train.MonitoredTrainingSession(hooks=[...])``)."""

    def __init__(
        self, root_rank: int, device: str = "", process_set: Any = global_process_set
    ) -> None:
        check_process_set(process_set)
        self.root_rank = root_rank

    def after_create_session(self, session: Any, coord: Any) -> None:
        variables = tf.compat.v1.global_variables()
        for index, (variable, value) in enumerate(
            zip(variables, session.run(variables), strict=True)
        ):
            array = np.array(value, copy=True).reshape(-1)  # 0-d values too
            core.broadcast(array, self.root_rank, out=array, name=f"hook.{index}")
            variable.load(array.reshape(np.shape(value)), session)


from . import elastic, keras  # noqa: E402 - hvd.keras and hvd.elastic, as Horovod's module has
from .sync_batch_norm import SyncBatchNormalization  # noqa: E402 - uses the ops above

__all__ = [
    *_BASICS,
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "elastic",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "join",
    "keras",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "reducescatter",
    "size_op",
    "util",
]
