"""Collectives on TensorFlow tensors, eagerly and inside ``tf.function`` (or a TF1 graph).

Every rank must call the same collectives, matched by `name` or, unnamed, by their order
(eagerly) or their op name in the graph (inside a graph, identical on ranks that build the
same graph). Shapes may differ between ranks only on the first dimension of `allgather`
and `alltoall`. When ranks disagree (dtype, shape, op, root), every rank raises
``tf.errors.FailedPreconditionError`` with ringplug's message saying who passed what,
eagerly and inside a graph alike; an argument the collective rejects raises
``tf.errors.InvalidArgumentError``.

The plain forms are differentiable: allreduce's gradient is reduced the same way,
allgather's is this rank's rows of the averaged gradient, broadcast's is the averaged
gradient on the root and zero elsewhere, alltoall's sends the rows back, reducescatter's
gathers the blocks. The ``_async`` forms return a `TensorHandle` at once (eagerly the
requests are in flight; inside a graph the handle holds the op's outputs) and have no
gradient. ``tf.IndexedSlices`` are allreduced by gathering their values and indices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import core
from ..core import runtime
from ..core.ops import Average, ReduceOp, as_op
from . import _ops


class TensorHandle:
    """A collective on tensors in flight; `wait()` returns its tensor(s).

    Eagerly the core's requests run while the caller goes on; inside a graph the handle
    holds the collective's graph outputs (the op runs where the graph runs it).
    """

    def __init__(self, result: Callable[[], Any], done: Callable[[], bool]) -> None:
        self._result = result
        self._done = done

    def done(self) -> bool:
        """Whether `wait()` would return at once."""
        return self._done()

    def wait(self) -> Any:
        """The collective's result (raises its error, as the plain form would)."""
        return self._result()

    synchronize = wait


def _dense(tensor: Any) -> Any:
    return tf.convert_to_tensor(tensor)


def _rows(value: Any) -> tf.TensorShape:
    """A tensor's static shape with the first dimension unknown (it may differ by rank)."""
    return tf.TensorShape([None]).concatenate(value.shape[1:]) if value.shape.rank else None


def _async(
    kind: str,
    start: _ops.Starter,
    inputs: list[Any],
    touts: list[tf.DType],
    shapes: list[Any],
    name: str | None,
    unpack: Callable[[list[Any]], Any],
) -> TensorHandle:
    if not tf.executing_eagerly():
        outputs = _ops.run(kind, start, inputs, touts, shapes, name)
        return TensorHandle(lambda: unpack(outputs), lambda: True)
    started = _ops.start_eagerly(start, kind, inputs, name)
    return TensorHandle(lambda: unpack(_ops.waited(started, touts)), started.done)


def _first(outputs: list[Any]) -> Any:
    return outputs[0]


# ---------------------------------------------------------------------------- allreduce
def _allreduce_dense(
    tensors: list[Any], op: ReduceOp, pre: float, post: float, name: str | None, kind: str
) -> list[Any]:
    """Differentiable allreduce of dense tensors as one request per dtype (the gradient is
    reduced the same way, unnamed: it runs where the backward pass reaches it)."""
    start = _ops.allreduce_starter(op, pre, post)

    def reduce(values: Sequence[Any], request: str | None) -> list[Any]:
        touts, shapes = [v.dtype for v in values], [v.shape for v in values]
        return _ops.run(kind, start, values, touts, shapes, request)

    return _ops.differentiable(
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
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """The reduction of `tensor` over every rank (a new tensor of its dtype and shape).

    Args:
        tensor: a tensor, variable, or ``tf.IndexedSlices`` (then gathered: Sum and Average
            only). Every rank passes the same dtype and shape.
        op: `Average` (default), `Sum`, `Min`, `Max`, `Product`, or their names. Integer
            Average and scaling round toward zero.
        name: the request's name, the same on every rank. Defaults to None (numbered).
        prescale_factor: multiplies each rank's values before the reduction. Defaults to 1.
        postscale_factor: multiplies the result. Defaults to 1.

    Example:
        >>> total = rtf.allreduce(tf.ones([3]), op="sum")  # doctest: +SKIP
    """
    reduce_op = as_op(op)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, reduce_op, prescale_factor, postscale_factor, name)
    return _allreduce_dense(
        [tensor], reduce_op, prescale_factor, postscale_factor, name, "Allreduce"
    )[0]


def grouped_allreduce(
    tensors: Sequence[Any],
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[Any]:
    """`allreduce` of several tensors as one request per dtype (``tf.IndexedSlices`` among
    them gathered); returns them in order. Arguments as `allreduce`."""
    reduce_op = as_op(op)
    tensors = list(tensors)
    results: list[Any] = [None] * len(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            part = None if name is None else f"{name}.{i}"
            results[i] = _sparse_allreduce(t, reduce_op, prescale_factor, postscale_factor, part)
    if dense:
        reduced = _allreduce_dense(
            [tensors[i] for i in dense],
            reduce_op,
            prescale_factor,
            postscale_factor,
            name,
            "GroupedAllreduce",
        )
        for i, r in zip(dense, reduced, strict=True):
            results[i] = r
    return results


def _allreduce_async(
    tensors: Sequence[Any],
    op: ReduceOp | str,
    name: str | None,
    pre: float,
    post: float,
    unpack: Callable[[list[Any]], Any],
) -> TensorHandle:
    values = [_dense(t) for t in tensors]
    start = _ops.allreduce_starter(as_op(op), pre, post)
    touts, shapes = [v.dtype for v in values], [v.shape for v in values]
    return _async("GroupedAllreduce", start, values, touts, shapes, name, unpack)


def allreduce_async(
    tensor: Any,
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start `allreduce` of a dense tensor; ``wait()`` returns the reduction.

    Example:
        >>> handle = rtf.allreduce_async(loss_sum, op="sum")  # doctest: +SKIP
        >>> ...                                              # other work meanwhile
        >>> total = handle.wait()
    """
    return _allreduce_async([tensor], op, name, prescale_factor, postscale_factor, _first)


def grouped_allreduce_async(
    tensors: Sequence[Any],
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start `grouped_allreduce` of dense tensors; ``wait()`` returns them in order."""
    return _allreduce_async(tensors, op, name, prescale_factor, postscale_factor, list)


# ---------------------------------------------------------------------------- allgather
def _rows_of(grad: Any, value: Any) -> Any:
    """This rank's rows of a gathered gradient (row counts gathered now)."""
    rows = tf.shape(value, out_type=tf.int64)[:1]
    counts = _ops.run("Allgather", _ops.allgather_starter, [rows], [tf.int64], [[None]], None)[0]
    offset = tf.reduce_sum(counts[: core.rank()])
    begin = tf.concat([[offset], tf.zeros([tf.rank(value) - 1], tf.int64)], 0)
    size = tf.concat([rows, tf.fill([tf.rank(value) - 1], tf.constant(-1, tf.int64))], 0)
    return tf.slice(grad, begin, size)


def _allgather_many(tensors: list[Any], name: str | None, kind: str) -> list[Any]:
    values = [_dense(t) for t in tensors]
    shapes = [_rows(v) or tf.TensorShape([None]) for v in values]

    def gather(*inputs: Any) -> list[Any]:
        touts = [v.dtype for v in inputs]
        return _ops.run(kind, _ops.allgather_starter, inputs, touts, shapes, name)

    def grad(upstream: list[Any], inputs: list[Any], outputs: list[Any]) -> list[Any]:
        averaged = _allreduce_dense(upstream, ReduceOp.AVERAGE, 1.0, 1.0, None, "Allreduce")
        return [_rows_of(a, v) for a, v in zip(averaged, inputs, strict=True)]

    return _ops.differentiable(gather, grad, values)


def allgather(tensor: Any, *, name: str | None = None) -> Any:
    """Every rank's `tensor` concatenated on the first dimension, in rank order.

    Ranks may pass different numbers of rows; the other dimensions and the dtype must
    agree. Differentiable: each rank's rows get the average of the ranks' gradients.
    A rank that has joined (`join`) makes the others' allgather fail.
    """
    return _allgather_many([tensor], name, "Allgather")[0]


def grouped_allgather(tensors: Sequence[Any], *, name: str | None = None) -> list[Any]:
    """`allgather` of several tensors together; returns them in order."""
    tensors = list(tensors)
    return _allgather_many(tensors, name, "GroupedAllgather") if tensors else []


def allgather_async(tensor: Any, *, name: str | None = None) -> TensorHandle:
    """Start `allgather`; ``wait()`` returns the gathered tensor."""
    value = _dense(tensor)
    shapes = [_rows(value) or tf.TensorShape([None])]
    return _async("Allgather", _ops.allgather_starter, [value], [value.dtype], shapes, name, _first)


# ---------------------------------------------------------------------------- broadcast
def _broadcast_many(tensors: list[Any], root_rank: int, name: str | None) -> list[Any]:
    values = [_dense(t) for t in tensors]
    start = _ops.broadcast_starter(root_rank)

    def run(*inputs: Any) -> list[Any]:
        touts, shapes = [v.dtype for v in inputs], [v.shape for v in inputs]
        return _ops.run("Broadcast", start, inputs, touts, shapes, name)

    def grad(upstream: list[Any], inputs: list[Any], outputs: list[Any]) -> list[Any]:
        # Every rank takes part in the reduction; only the root's input had an effect.
        averaged = _allreduce_dense(upstream, ReduceOp.AVERAGE, 1.0, 1.0, None, "Allreduce")
        return averaged if core.rank() == root_rank else [a * 0 for a in averaged]

    return _ops.differentiable(run, grad, values)


def broadcast(tensor: Any, root_rank: int = 0, *, name: str | None = None) -> Any:
    """`root_rank`'s `tensor` on every rank (the same dtype and shape on every rank).

    Differentiable: the averaged gradient on the root, zero elsewhere.
    """
    return _broadcast_many([tensor], root_rank, name)[0]


def grouped_broadcast(
    tensors: Sequence[Any], root_rank: int = 0, *, name: str | None = None
) -> list[Any]:
    """`broadcast` of several tensors together; returns them in order."""
    tensors = list(tensors)
    return _broadcast_many(tensors, root_rank, name) if tensors else []


def broadcast_async(tensor: Any, root_rank: int = 0, *, name: str | None = None) -> TensorHandle:
    """Start `broadcast`; ``wait()`` returns root's tensor."""
    value = _dense(tensor)
    start = _ops.broadcast_starter(root_rank)
    return _async("Broadcast", start, [value], [value.dtype], [value.shape], name, _first)


def broadcast_variables(
    variables: Sequence[Any], root_rank: int = 0, *, name: str | None = None
) -> Any:
    """Assign `root_rank`'s values to `variables` (``tf.Variable`` or Keras variables) on
    every rank, so that every rank starts from the same state.

    Eagerly it is done on return (and returns None); inside a graph the returned op does
    it. Every rank passes the same variables in the same order.

    Example:
        >>> rtf.broadcast_variables(model.variables, root_rank=0)  # doctest: +SKIP
    """
    variables = [_backend_variable(v) for v in variables]
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    values = _broadcast_many(
        [v.read_value() if hasattr(v, "read_value") else v for v in variables], root_rank, name
    )
    assigned = [v.assign(value) for v, value in zip(variables, values, strict=True)]
    return None if tf.executing_eagerly() else tf.group(*assigned)


def _backend_variable(variable: Any) -> Any:
    """The variable that holds `variable`'s value: a Keras 3 variable's TensorFlow variable
    (its ``value`` property), else `variable` itself."""
    if isinstance(getattr(type(variable), "value", None), property):
        return variable.value
    return variable


# ---------------------------------------------------------------------------- alltoall
def _alltoall_raw(value: Any, splits: Any, name: str | None) -> list[Any]:
    return _ops.run(
        "Alltoall",
        _ops.alltoall_starter,
        [value, splits],
        [value.dtype, tf.int32],
        [_rows(value), [core.size()]],
        name,
    )


def _splits(splits: Any) -> Any:
    return tf.constant([], tf.int32) if splits is None else tf.convert_to_tensor(splits)


def alltoall(tensor: Any, splits: Any = None, *, name: str | None = None) -> tuple[Any, Any]:
    """Send rows ``splits[i]`` of `tensor` to rank i (an even split without `splits`).

    Returns the rows received, in rank order, and the int32 counts received from each
    rank. Differentiable (the gradient's rows go back where they came from).
    """
    value = _dense(tensor)
    split_tensor = _splits(splits)

    def grad(upstream: list[Any], inputs: list[Any], outputs: list[Any]) -> list[Any]:
        # Each rank sends back what it received.
        return [_alltoall_raw(upstream[0], outputs[1], None)[0]]

    received, counts = _ops.differentiable(
        lambda x: _alltoall_raw(x, split_tensor, name), grad, [value]
    )
    return received, counts


def alltoall_async(tensor: Any, splits: Any = None, *, name: str | None = None) -> TensorHandle:
    """Start `alltoall`; ``wait()`` returns the rows received and the counts per rank."""
    value = _dense(tensor)
    return _async(
        "Alltoall",
        _ops.alltoall_starter,
        [value, _splits(splits)],
        [value.dtype, tf.int32],
        [_rows(value), [core.size()]],
        name,
        tuple,
    )


# ---------------------------------------------------------------------------- reducescatter
def _reducescatter_many(
    tensors: list[Any], op: ReduceOp, pre: float, post: float, name: str | None, kind: str
) -> list[Any]:
    values = [_dense(t) for t in tensors]
    for value in values:
        if value.shape.rank == 0:
            raise ValueError(
                "reducescatter needs a tensor with at least one dimension to split over the ranks."
            )
    shapes = [_rows(v) for v in values]
    start = _ops.reducescatter_starter(op, pre, post)

    def run(*inputs: Any) -> list[Any]:
        return _ops.run(kind, start, inputs, [v.dtype for v in inputs], shapes, name)

    def grad(upstream: list[Any], inputs: list[Any], outputs: list[Any]) -> list[Any]:
        factor = (core.size() if op is ReduceOp.SUM else 1.0) * pre * post
        scaled = [u * tf.cast(factor, u.dtype) if factor != 1.0 else u for u in upstream]
        touts, shapes = [s.dtype for s in scaled], [v.shape for v in inputs]
        return _ops.run(kind, _ops.allgather_starter, scaled, touts, shapes, None)

    return _ops.differentiable(run, grad, values)


def reducescatter(
    tensor: Any,
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """This rank's block of rows of the reduction of `tensor` over every rank (earlier
    ranks get a row more when the rows do not divide). Arguments as `allreduce`."""
    return _reducescatter_many(
        [tensor], as_op(op), prescale_factor, postscale_factor, name, "Reducescatter"
    )[0]


def grouped_reducescatter(
    tensors: Sequence[Any],
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[Any]:
    """`reducescatter` of several tensors together; returns the blocks in order."""
    tensors = list(tensors)
    if not tensors:
        return []
    return _reducescatter_many(
        tensors, as_op(op), prescale_factor, postscale_factor, name, "GroupedReducescatter"
    )


def reducescatter_async(
    tensor: Any,
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorHandle:
    """Start `reducescatter`; ``wait()`` returns this rank's block."""
    value = _dense(tensor)
    if value.shape.rank == 0:
        raise ValueError(
            "reducescatter needs a tensor with at least one dimension to split over the ranks."
        )
    start = _ops.reducescatter_starter(as_op(op), prescale_factor, postscale_factor)
    return _async("Reducescatter", start, [value], [value.dtype], [_rows(value)], name, _first)


# ---------------------------------------------------------------------------- the rest
def join() -> Any:
    """This rank has no more data: take part in the others' allreduces with zeros until
    every rank has joined; returns (an int32 tensor of) the last rank to join."""
    return _ops.run("Join", _ops.join_starter, [], [tf.int32], [[]], None)[0]


def barrier() -> None:
    """Wait until every rank has called barrier (eagerly)."""
    core.barrier()


class BroadcastVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1 graphs: when a ``tf.compat.v1.train.MonitoredTrainingSession`` is created, every
    rank's global variables get `root_rank`'s values.

    Args:
        root_rank: the rank whose values every rank starts from. Defaults to 0.

    Example:
        >>> hooks = [rtf.BroadcastVariablesHook(0)]  # doctest: +SKIP
        >>> with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session:
        ...     session.run(train_op)
    """

    def __init__(self, root_rank: int = 0) -> None:
        self.root_rank = root_rank
        self._engine = runtime.scope.get()  # made in a process set's scope: among its ranks

    def after_create_session(self, session: Any, coord: Any) -> None:
        token = runtime.scope.set(self._engine)
        try:
            self._broadcast(session)
        finally:
            runtime.scope.reset(token)

    def _broadcast(self, session: Any) -> None:
        variables = tf.compat.v1.global_variables()
        for index, (variable, value) in enumerate(
            zip(variables, session.run(variables), strict=True)
        ):
            array = np.array(value, copy=True).reshape(-1)  # 0-d values too
            core.broadcast(array, self.root_rank, out=array, name=f"hook.{index}")
            variable.load(array.reshape(np.shape(value)), session)
