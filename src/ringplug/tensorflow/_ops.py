"""How a collective on TensorFlow tensors runs: the core's requests on the tensors' host
memory, started by one function per kind, either at once (eagerly) or as a graph op.

- Eagerly the request runs on the tensors' numpy views, and an error is raised as the
  TensorFlow error a collective raises (`failed`).
- Inside a ``tf.function`` or a TF1 graph it becomes a stateful graph op: the function
  compiles it into its step, it keeps program order there (stateful ops are ordered), and
  it runs each time the step runs. An unnamed one is named after the graph's own unique op
  name, identical on every rank that builds the same graph, so the ranks match the
  requests by name in whatever order a session runs them. The op is `_kernel`'s
  asynchronous one, which holds no TensorFlow thread while it waits and fails the step
  with ``tf.errors.FailedPreconditionError`` on a mismatch; where that op cannot be
  registered, a stateful ``tf.numpy_function`` that blocks its thread, failing through
  the check op of `_status`.
- `differentiable` gives a collective its gradient with ``tf.custom_gradient``.
- A collective runs on the engine current where it is written (`runtime.scope`: a process
  set's, inside its scope): a graph op keeps that engine for each time it runs, and a
  gradient runs on its forward's engine, wherever the tape or the graph reaches it.

Each starter takes ``(name, *arrays)`` and returns a `Started`: the core's handles, waited
for all together by ``wait()`` (every handle, then the first error raised).
"""

from __future__ import annotations

import re
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import core
from ..core import collectives as _core
from ..core import runtime
from ..core.errors import RingplugError
from ..core.kinds.base import waited_at_once
from ..core.ops import ReduceOp, integer_scaling
from . import _kernel, _status

# Unsigned types the core does not reduce travel as the signed type of their width in the
# collectives that only move data (allgather, broadcast, alltoall): the bits are the same.
_MOVED_AS = {
    np.dtype(np.uint16): np.dtype(np.int16),
    np.dtype(np.uint32): np.dtype(np.int32),
    np.dtype(np.uint64): np.dtype(np.int64),
}


def storage(array: np.ndarray, moved: bool = False) -> tuple[np.ndarray, str | None]:
    """A contiguous array the core reads, and the dtype to read it as (bfloat16 by its
    raw 16-bit words; with `moved`, unsigned types by their signed twin's)."""
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return array.view(np.uint16), "bfloat16"
    if moved and array.dtype in _MOVED_AS:
        return array.view(_MOVED_AS[array.dtype]), None
    return array, None


def restore(result: np.ndarray, like: np.ndarray) -> np.ndarray:
    """`result` read back as `like`'s dtype (undoes `storage`'s views)."""
    if like.dtype.name == "bfloat16" or like.dtype in _MOVED_AS:
        return result.view(like.dtype)
    return result


def failed(exc: BaseException) -> BaseException:
    """A ringplug failure as the TensorFlow error a collective raises: a mismatch or a lost
    peer is ``FailedPreconditionError``, a rejected argument ``InvalidArgumentError``."""
    if isinstance(exc, RingplugError):
        return tf.errors.FailedPreconditionError(None, None, str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        return tf.errors.InvalidArgumentError(None, None, str(exc))
    return exc


class Started:
    """A collective's core requests in flight; `wait()` returns its arrays in order.

    Args:
        parts: ``(handle, finish)`` pairs; ``finish(handle.wait())`` gives ``(index, array)``
            pairs for the results it fills.
        count: how many arrays the collective returns.
    """

    def __init__(self, parts: list[tuple[Any, Callable[[Any], Any]]], count: int) -> None:
        self._parts = parts
        self._count = count

    def done(self) -> bool:
        return all(handle.done() for handle, _ in self._parts)

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once every request has finished, on the thread that finished
        the last one (the engine's: it must be quick)."""
        left = [len(self._parts)]
        lock = threading.Lock()

        def one_done(_: Any) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                callback()

        if not self._parts:
            callback()
        for handle, _ in self._parts:
            handle.add_done_callback(one_done)

    def wait(self) -> list[np.ndarray]:
        results: list[Any] = [None] * self._count
        error = None
        for handle, finish in self._parts:
            try:
                value = handle.wait()
            except Exception as exc:  # noqa: BLE001 - every handle is waited for, then raised
                error = error or exc
                continue
            for index, array in finish(value):
                results[index] = array
        if error is not None:
            raise error
        return results


Starter = Callable[..., Started]


def op_name(kind: str, name: str | None) -> str | None:
    """The collective's name: the caller's, else none eagerly (ringplug numbers unnamed
    calls), else the graph's unique op name (the same on every rank building this graph;
    a process set's counted apart)."""
    if name is not None:
        return re.sub(r"[^A-Za-z0-9_./-]", "_", str(name))
    if tf.executing_eagerly():
        return None
    engine = runtime.scope.get()
    if engine is not None and engine.ranks is not None:
        # A process set's ops count apart from the world's, so that ranks outside the set
        # (which do not build them) still name their world collectives as its members do.
        kind = f"{kind}_set{zlib.crc32(repr(tuple(engine.ranks)).encode()):08x}"
    return tf.compat.v1.get_default_graph().unique_name(f"ringplug{kind}")


def start_eagerly(start: Starter, kind: str, inputs: Sequence[Any], name: str | None) -> Started:
    """Start the collective on eager tensors now; errors raised as TensorFlow's."""
    tensors = [tf.convert_to_tensor(t) for t in inputs]
    try:
        return start(op_name(kind, name), *[t.numpy() for t in tensors])
    except (RingplugError, ValueError, TypeError) as exc:
        raise failed(exc) from exc


def waited(started: Started, touts: Sequence[tf.DType]) -> list[Any]:
    """The eager tensors of a started collective, once it is done."""
    try:
        results = started.wait()
    except (RingplugError, ValueError, TypeError) as exc:
        raise failed(exc) from exc
    return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, touts, strict=True)]


def in_scope(start: Starter, engine: Any) -> Starter:
    """`start` run with `engine` current (None: the world's), whichever thread calls it."""

    def scoped(*args: Any) -> Started:
        token = runtime.scope.set(engine)
        try:
            return start(*args)
        finally:
            runtime.scope.reset(token)

    return scoped


def run(
    kind: str,
    start: Starter,
    inputs: Sequence[Any],
    touts: Sequence[tf.DType],
    shapes: Sequence[Any],
    name: str | None,
) -> list[Any]:
    """Run the collective `start` begins, now (eagerly) or as a stateful graph op whose
    outputs have dtypes `touts` and static `shapes`."""
    if tf.executing_eagerly():
        # Waited for at once: its caller runs its cycle itself, waking no engine thread
        # (see `ringplug.core.kinds.base.waited_at_once`).
        with waited_at_once():
            started = start_eagerly(start, kind, inputs, name)
        return waited(started, touts)
    request = op_name(kind, name)
    tensors = [tf.convert_to_tensor(t) for t in inputs]
    # The graph runs the op on TensorFlow's threads, outside the scope it was written in.
    start = in_scope(start, runtime.scope.get())
    if _kernel.available():
        outputs = _kernel.collective(
            lambda arrays: start(request, *arrays), tensors, touts, f"ringplug_{kind.lower()}"
        )
        for output, shape in zip(outputs, shapes, strict=True):
            output.set_shape(shape)
        return outputs
    checked = _status.available()

    def graph_compute(*arrays: np.ndarray) -> list[np.ndarray]:
        if not checked:
            return [np.asarray(r) for r in start(request, *arrays).wait()]
        try:
            results = [np.asarray(r) for r in start(request, *arrays).wait()]
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


def differentiable(
    forward: Callable[..., list[Any]],
    backward: Callable[[list[Any], list[Any], list[Any]], list[Any]],
    values: list[Any],
) -> list[Any]:
    """`forward(*values)` (a list of outputs), whose gradient is `backward(upstream,
    inputs, outputs)` (one per input). Outputs nothing flowed back to get zeros. Without a
    floating input there is no gradient to define."""
    if not any(v.dtype.is_floating for v in values):
        return forward(*values)
    engine = runtime.scope.get()  # the gradient's collectives run among the same ranks

    @tf.custom_gradient
    def collective(*inputs: Any) -> Any:
        outputs = forward(*inputs)

        def grad(*upstream: Any) -> Any:
            upstream = [
                tf.zeros_like(o) if u is None else u for u, o in zip(upstream, outputs, strict=True)
            ]
            token = runtime.scope.set(engine)
            try:
                back = backward(upstream, list(inputs), outputs)
            finally:
                runtime.scope.reset(token)
            return back if len(back) > 1 else back[0]

        return (outputs if len(outputs) > 1 else outputs[0]), grad

    result = collective(*values)
    return list(result) if isinstance(result, (list, tuple)) else [result]


# ---------------------------------------------------------------------------- starters
def _integer(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.integer)


def _scaling(
    dtype: np.dtype, op: ReduceOp, pre: float, post: float
) -> tuple[ReduceOp, float, float, float | None]:
    """(core op, core prescale, core postscale, factor after) for `dtype`: integers with
    Average or scale factors are summed by the core and scaled here
    (`ringplug.core.ops.integer_scaling`); the factor after is None where the core scales."""
    after = integer_scaling(op, pre, post, core.size()) if _integer(dtype) else None
    if after is None:
        return op, pre, post, None
    return ReduceOp.SUM, 1.0, 1.0, after


def _scaled(result: np.ndarray, like: np.ndarray, after: float | None) -> np.ndarray:
    result = restore(np.asarray(result), like)
    if after is not None and after != 1.0:
        result = (result.astype(np.float64) * after).astype(like.dtype)
    return result


def _part(name: str | None, index: int, count: int) -> str | None:
    return name if name is None or count == 1 else f"{name}.{index}"


def allreduce_starter(op: ReduceOp, pre: float = 1.0, post: float = 1.0) -> Starter:
    """Allreduce several arrays, one grouped request per dtype."""

    def start(name: str | None, *arrays: np.ndarray) -> Started:
        groups: dict[str, list[int]] = {}
        for index, array in enumerate(arrays):
            groups.setdefault(str(array.dtype), []).append(index)
        parts = []
        for dtype, indices in groups.items():
            members = [storage(arrays[i]) for i in indices]
            core_op, core_pre, core_post, after = _scaling(arrays[indices[0]].dtype, op, pre, post)
            if after is not None and pre != 1.0:
                members = [((m * pre).astype(m.dtype), d) for m, d in members]
            request = name if len(groups) == 1 or name is None else f"{name}.{dtype}"
            handle = _core.grouped_allreduce_async(
                [m for m, _ in members],
                core_op,
                name=request,
                dtype=members[0][1],
                prescale_factor=core_pre,
                postscale_factor=core_post,
            )

            def finish(reduced: Any, indices: list[int] = indices, after: Any = after) -> Any:
                return [
                    (i, _scaled(r, arrays[i], after).reshape(arrays[i].shape))
                    for i, r in zip(indices, reduced, strict=True)
                ]

            parts.append((handle, finish))
        return Started(parts, len(arrays))

    return start


def allgather_starter(name: str | None, *arrays: np.ndarray) -> Started:
    """Allgather several arrays (one request each)."""
    parts = []
    for index, array in enumerate(arrays):
        work, dtype = storage(array, moved=True)
        handle = _core.allgather_async(
            work, name=_part(name, index, len(arrays)), dtype=dtype, refuse_joined=True
        )
        parts.append((handle, lambda r, i=index, a=array: [(i, restore(np.asarray(r), a))]))
    return Started(parts, len(arrays))


def broadcast_starter(root_rank: int) -> Starter:
    """Broadcast several arrays from `root_rank` (one request each)."""

    def start(name: str | None, *arrays: np.ndarray) -> Started:
        parts = []
        for index, array in enumerate(arrays):
            work, dtype = storage(np.array(array, copy=True), moved=True)
            handle = _core.broadcast_async(
                work,
                root_rank,
                out=work,
                name=_part(name, index, len(arrays)),
                dtype=dtype,
                refuse_joined=True,
            )
            parts.append(
                (
                    handle,
                    lambda _, i=index, w=work, a=array: [(i, restore(w, a).reshape(np.shape(a)))],
                )
            )
        return Started(parts, len(arrays))

    return start


def alltoall_starter(name: str | None, array: np.ndarray, splits: np.ndarray) -> Started:
    """Alltoall one array by `splits` (empty: an even split); gives rows and counts."""
    work, dtype = storage(array, moved=True)
    if splits.size == 0:
        splits = None
    elif not _integer(splits.dtype):
        raise ValueError(f"alltoall splits must be integers, got {splits.dtype}.")
    handle = _core.alltoall_async(work, splits, name=name, dtype=dtype)

    def finish(result: Any) -> Any:
        received, counts = result
        return [(0, restore(np.asarray(received), array)), (1, np.asarray(counts, np.int32))]

    return Started([(handle, finish)], 2)


def reducescatter_starter(op: ReduceOp, pre: float = 1.0, post: float = 1.0) -> Starter:
    """Reducescatter several arrays (one request each)."""

    def start(name: str | None, *arrays: np.ndarray) -> Started:
        parts = []
        for index, array in enumerate(arrays):
            work, dtype = storage(array)
            core_op, core_pre, core_post, after = _scaling(array.dtype, op, pre, post)
            if after is not None and pre != 1.0:
                work = (work * pre).astype(work.dtype)
            handle = _core.reducescatter_async(
                work,
                core_op,
                name=_part(name, index, len(arrays)),
                dtype=dtype,
                prescale_factor=core_pre,
                postscale_factor=core_post,
            )
            parts.append((handle, lambda r, i=index, a=array, f=after: [(i, _scaled(r, a, f))]))
        return Started(parts, len(arrays))

    return start


def computed(results: Sequence[np.ndarray]) -> Started:
    """A collective already done (synchronous work), as a `Started`."""
    handle = core.Handle.completed("computed", list(results))
    return Started([(handle, lambda r: list(enumerate(r)))], len(results))


def join_starter(name: str | None) -> Started:
    """Join (the last rank to join, as an int32 array); in flight until every rank has
    joined, like any other collective (a graph's join holds no thread meanwhile)."""
    handle = runtime.engine().join()
    return Started([(handle, lambda last: [(0, np.asarray(last, np.int32))])], 1)
