"""The core's collectives on Keras values: one fused allreduce of a step's gradients, from
inside whatever Keras's backend runs; and root's values into Keras variables on every rank
(`broadcast_variables`, eager: RingBroadcast, BackupAndRestore and the elastic states).

- TensorFlow: `ringplug.tensorflow`'s graph op (a ``tf.numpy_function(..., stateful=True)``)
  in the compiled train step. Stateful ops keep program order, so every rank reduces in
  the same place of the step (stateless ones were reordered across threads in every trial).
  GPU gradients take a ``tf.py_function`` instead and go to NCCL by DLPack (`_tf_gpu`).
- torch: eager tensors, reduced through `ringplug.torch` (CUDA tensors through NCCL).
- JAX: an ordered ``io_callback`` inside the jitted step.

Gradients are grouped by dtype; each group is one request named after the optimizer, so
repeated steps hit the negotiation cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from .. import core, diagnose
from ..core import activity
from ..core.ops import ReduceOp
from . import _tf_gpu


def reduce_numpy(
    arrays: Sequence[np.ndarray], op: ReduceOp, name: str, fp16: bool
) -> list[np.ndarray]:
    """The reductions of `arrays` (new arrays, same dtypes), one request per dtype."""
    clock = diagnose.active()
    if clock is not None:
        clock.backward_ended(time.perf_counter())  # Keras reduces after the whole backward
    else:
        activity.set_phase(activity.REDUCING)
    nbytes = 0
    groups: dict[np.dtype, list[int]] = {}
    for index, array in enumerate(arrays):
        groups.setdefault(np.asarray(array).dtype, []).append(index)
    handles = []
    for dtype, indices in groups.items():
        members = [np.ascontiguousarray(arrays[i]) for i in indices]
        if fp16 and dtype in (np.float32, np.float64):
            members = [member.astype(np.float16) for member in members]
        nbytes += sum(member.nbytes for member in members)
        handles.append((indices, core.grouped_allreduce_async(members, op, name=f"{name}.{dtype}")))
    results: list[np.ndarray] = [np.empty(0)] * len(arrays)
    for indices, handle in handles:
        for index, result in zip(indices, handle.wait(), strict=True):
            results[index] = result.astype(np.asarray(arrays[index]).dtype, copy=False)
    if clock is not None:
        clock.reduced(time.perf_counter(), nbytes)
    else:
        activity.set_phase(activity.STEPPING)
    return results


def reduce_gradients(
    grads: list[Any], op: ReduceOp, name: str, fp16: bool, when: Any = None
) -> list[Any]:
    """`grads` (backend tensors, None for no gradient) reduced over every rank; with `when`
    (a traced JAX boolean, the same on every rank), only where it is true."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present or core.size() == 1:
        return list(grads)
    backend = keras.backend.backend()
    values = [grads[i] for i in present]
    if backend == "tensorflow":
        reduced = _tensorflow(values, op, name, fp16)
    elif backend == "torch":
        reduced = _torch(values, op, name, fp16)
    elif backend == "jax":
        reduced = _jax(values, op, name, fp16, when)
    else:
        raise NotImplementedError(
            f"ringplug.keras supports the tensorflow, torch and jax backends, not {backend!r}."
        )
    out = list(grads)
    for index, value in zip(present, reduced, strict=True):
        out[index] = value
    return out


def _tensorflow(grads: list[Any], op: ReduceOp, name: str, fp16: bool) -> list[Any]:
    import tensorflow as tf

    dense = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices (embeddings) -> dense
    if _tf_gpu.on_gpu(dense):
        # GPU gradients go to NCCL by DLPack; py_function hands over eager device tensors
        # (numpy_function would copy them to the host) and, being stateful, keeps its place.
        engine = core.runtime.scope.get()  # a process set's: py_function runs outside it

        def on_gpu(*values: Any) -> list[Any]:
            token = core.runtime.scope.set(engine)
            try:
                return _tf_gpu.reduce_gradients(values, op, name, fp16)
            finally:
                core.runtime.scope.reset(token)

        reduced = tf.py_function(
            on_gpu,
            dense,
            Tout=[g.dtype for g in dense],
            name="ringplug_allreduce_gpu",
        )
        for out, grad in zip(reduced, dense, strict=True):
            out.set_shape(grad.shape)
        return list(reduced)

    from ..tensorflow import _ops

    # ringplug.tensorflow's graph op: stateful (program order), failing the step with
    # FailedPreconditionError and ringplug's message when the ranks disagree.
    return _ops.run(
        "Allreduce",
        lambda _, *arrays: _ops.computed(reduce_numpy(arrays, op, name, fp16)),
        dense,
        [g.dtype for g in dense],
        [g.shape for g in dense],
        name,
    )


def _torch(grads: list[Any], op: ReduceOp, name: str, fp16: bool) -> list[Any]:
    import torch

    from ..torch.collectives import as_numpy, from_numpy, grouped_allreduce_async_

    if all(g.device.type == "cuda" for g in grads):  # NCCL, one request per dtype
        wide = (torch.float32, torch.float64)
        # One copy each, the reduction's own (fp16: the cast is that copy).
        works = [
            g.detach().half() if fp16 and g.dtype in wide else g.detach().clone() for g in grads
        ]
        groups: dict[Any, list[int]] = {}
        for index, work in enumerate(works):
            groups.setdefault(work.dtype, []).append(index)
        handles = [
            grouped_allreduce_async_([works[i] for i in indices], op, name=f"{name}.{dtype}")
            for dtype, indices in groups.items()
        ]
        for handle in handles:
            handle.wait()
        return [w.to(g.dtype) for w, g in zip(works, grads, strict=True)]
    if any(g.device.type != "cpu" for g in grads):  # a mix: through host memory
        host = [g.detach().cpu() for g in grads]
        return [r.to(g.device) for r, g in zip(_torch(host, op, name, fp16), grads, strict=True)]
    works = [g.detach().contiguous() for g in grads]
    if any(w.dtype is torch.bfloat16 for w in works):
        works = [w.float() if w.dtype is torch.bfloat16 else w for w in works]
    arrays = [as_numpy(w)[0] for w in works]
    reduced = reduce_numpy(arrays, op, name, fp16)
    return [from_numpy(r, w).to(g.dtype) for r, w, g in zip(reduced, works, grads, strict=True)]


def _jax(grads: list[Any], op: ReduceOp, name: str, fp16: bool, when: Any) -> list[Any]:
    import jax
    from jax.experimental import io_callback

    shapes = [jax.ShapeDtypeStruct(g.shape, g.dtype) for g in grads]
    engine = core.runtime.scope.get()  # the callback runs outside a process set's scope

    def run(*arrays: Any) -> list[np.ndarray]:
        token = core.runtime.scope.set(engine)
        try:
            return reduce_numpy([np.asarray(a) for a in arrays], op, name, fp16)
        finally:
            core.runtime.scope.reset(token)

    def reduced(values: list[Any]) -> list[Any]:
        return list(io_callback(run, shapes, *values, ordered=True))

    if when is None:
        return reduced(grads)
    return jax.lax.cond(when, reduced, list, list(grads))


def broadcast_variables(variables: list[Any], root_rank: int = 0, name: str = "keras") -> None:
    """Assign root's values to `variables` on every rank (one broadcast per dtype)."""
    values = [keras.ops.convert_to_numpy(v) for v in variables]
    groups: dict[np.dtype, list[int]] = {}
    for index, value in enumerate(values):
        groups.setdefault(value.dtype, []).append(index)
    for dtype, indices in groups.items():
        flat = np.concatenate([values[i].reshape(-1) for i in indices])
        core.broadcast(flat, root_rank, out=flat, name=f"{name}.broadcast.{dtype}")
        offset = 0
        for i in indices:
            count = values[i].size
            variables[i].assign(flat[offset : offset + count].reshape(values[i].shape))
            offset += count
