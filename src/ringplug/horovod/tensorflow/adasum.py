"""Horovod's Adasum for TensorFlow: ``hvd.allreduce(..., op=hvd.Adasum)``,
``hvd.grouped_allreduce`` and ``hvd.DistributedGradientTape(..., op=hvd.Adasum)``, eagerly,
in ``tf.function`` and in TF1 graphs, on the core's Adasum kind
(`ringplug.core.kinds.adasum`).

As in Horovod's CPU build, a result is the Adasum itself (no division by the number of
ranks), and the number of ranks must be a power of two. The gradient of an Adasum is the
Adasum of the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ...core import collectives as core_collectives
from ...core.kinds.adasum import check_size
from ...tensorflow import _ops
from ...tensorflow.tape import DistributedGradientTape


def _starter(pre: float, post: float) -> _ops.Starter:
    """Adasum of several arrays, one request each (they run fused)."""

    def start(name: str | None, *arrays: np.ndarray) -> _ops.Started:
        parts = []
        for index, array in enumerate(arrays):
            work = np.array(array, copy=True, order="C")
            if pre != 1.0:
                work *= pre
            member = name if name is None or len(arrays) == 1 else f"{name}.{index}"
            handle = core_collectives.adasum_async(work, out=work, name=member)

            def finish(result: np.ndarray, index: int = index) -> list[tuple[int, np.ndarray]]:
                if post != 1.0:
                    result *= post
                return [(index, result)]

            parts.append((handle, finish))
        return _ops.Started(parts, len(arrays))

    return start


def _check(tensors: Sequence[Any]) -> None:
    check_size()
    for tensor in tensors:
        if isinstance(tensor, tf.IndexedSlices):
            raise NotImplementedError(
                "Adasum does not reduce tf.IndexedSlices; pass sparse_as_dense=True, or "
                "tf.convert_to_tensor() them first."
            )


def grouped_adasum(
    tensors: Sequence[Any], pre: float = 1.0, post: float = 1.0, name: str | None = None
) -> list[Any]:
    """The Adasum of each of `tensors` over every rank (each its own dot products and
    norms), as new tensors; differentiable. NotImplementedError on every rank when the
    number of ranks is not a power of two, or for ``tf.IndexedSlices``."""
    _check(tensors)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    kind = "Adasum"

    def reduce(values: Sequence[Any], request: str | None, scales: tuple) -> list[Any]:
        touts, shapes = [v.dtype for v in values], [v.shape for v in values]
        return _ops.run(kind, _starter(*scales), values, touts, shapes, request)

    return _ops.differentiable(
        lambda *values: reduce(values, name, (pre, post)),
        lambda upstream, inputs, outputs: reduce(upstream, None, (pre, post)),
        list(tensors),
    )


def reduce_compressed(
    tensors: Sequence[Any], compression: Any, pre: float, post: float, name: str | None
) -> list[Any]:
    """`grouped_adasum` of `tensors` as `compression` sends them."""
    _check(tensors)
    packed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    reduced = grouped_adasum([c for c, _ in packed], pre, post, name)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed, strict=True)]


class AdasumGradientTape(DistributedGradientTape):
    """A `DistributedGradientTape` whose gradients are combined by Adasum, as Horovod's
    ``DistributedGradientTape(op=hvd.Adasum)``; local variables' gradients stay local."""

    def _reduce(self, grads: list[Any]) -> list[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        values = [grads[i] for i in present]
        if self._sparse_as_dense:
            values = [
                tf.convert_to_tensor(v) if isinstance(v, tf.IndexedSlices) else v for v in values
            ]
        out = list(grads)
        if values:
            reduced = reduce_compressed(values, self._compression, 1.0, 1.0, None)
            for index, value in zip(present, reduced, strict=True):
                out[index] = value
        return out
