"""TensorFlow GPU tensors through NCCL: exported by DLPack, results in fresh tensors.

TensorFlow exposes no current stream and its tensors are immutable, so this module
synchronises the devices before NCCL reads the inputs (they may still be computing),
maps TensorFlow's GPU numbers (which count only the GPUs it may use) to CUDA's,
allocates each result as a new uninitialised tensor on the input's device, and hands
both to the GPU data plane by address. The engine returns once NCCL has finished, so the
results are complete when TensorFlow sees them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..core import device_collectives
from ..core.gpu.device import from_dlpack
from ..core.ops import ReduceOp
from ._devices import physical_gpu


def on_gpu(tensors: Sequence[Any]) -> bool:
    """Whether every tensor lives on a GPU (a mix goes through host memory instead)."""
    return bool(tensors) and all("GPU" in (t.device or "").upper() for t in tensors)


def _export(tensor: Any) -> Any:
    import tensorflow as tf

    buffer = from_dlpack(tf.experimental.dlpack.to_dlpack(tensor), tensor)
    # DLPack carries TensorFlow's own GPU number; NCCL needs the CUDA device's.
    return dataclasses.replace(buffer, device=physical_gpu(buffer.device))


def allreduce(
    tensors: Sequence[Any],
    op: ReduceOp | str,
    name: str,
    *,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[Any]:
    """The reductions of eager GPU `tensors` of one dtype, as new tensors (one request)."""
    import tensorflow as tf

    tf.test.experimental.sync_devices()  # the inputs are computed
    results = []
    for tensor in tensors:
        with tf.device(tensor.device):
            results.append(tf.raw_ops.Empty(shape=tf.shape(tensor), dtype=tensor.dtype))
    tf.test.experimental.sync_devices()  # the results are allocated
    sends = [_export(tensor) for tensor in tensors]
    outs = [_export(result) for result in results]
    handle = device_collectives.allreduce_async(
        sends,
        outs,
        [tuple(tensor.shape) for tensor in tensors],
        op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        name=name,
    )
    handle.wait()
    return results


def reduce_gradients(grads: Sequence[Any], op: ReduceOp, name: str, fp16: bool) -> list[Any]:
    """A step's GPU gradients reduced over every rank, one request per dtype."""
    import tensorflow as tf

    groups: dict[Any, list[int]] = {}
    for index, grad in enumerate(grads):
        groups.setdefault(grad.dtype, []).append(index)
    results: list[Any] = [None] * len(grads)
    for dtype, indices in groups.items():
        members = [grads[i] for i in indices]
        if fp16 and dtype in (tf.float32, tf.float64):
            members = [tf.cast(m, tf.float16) for m in members]
        reduced = allreduce(members, op, f"{name}.{dtype.name}")
        for index, value in zip(indices, reduced, strict=True):
            results[index] = tf.cast(value, dtype) if value.dtype != dtype else value
    return results
