"""`DistributedGradientTape`: a ``tf.GradientTape`` whose gradients are averaged over every
rank, and `reduce_gradients`, the one grouped reduction it makes (`Compression` is
`ringplug.compression`'s, the one every adapter takes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import core
from ..compression import Compression
from ..core import runtime
from ..core.ops import Average, ReduceOp, as_op
from .collectives import _backend_variable, grouped_allreduce


def reduce_gradients(
    grads: Sequence[Any],
    op: ReduceOp | str = Average,
    *,
    name: str | None = None,
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
) -> list[Any]:
    """`grads` reduced over every rank as one grouped request (None stays None).

    Args:
        grads: tensors, ``tf.IndexedSlices`` (gathered) or None, as a tape returns them.
        op: `Average` (default) or `Sum`.
        name: the request's name, the same on every rank. Defaults to None.
        compression: `Compression.none` (default) or `Compression.fp16`.
        sparse_as_dense: reduce ``tf.IndexedSlices`` as dense tensors. Defaults to False.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            size/this after it. Defaults to 1.

    Example:
        >>> grads = rtf.reduce_gradients(tape.gradient(loss, model.trainable_variables))
        ... # doctest: +SKIP
    """
    op = as_op(op)
    if core.size() == 1:
        return list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    values = [grads[i] for i in present]
    if sparse_as_dense:
        values = [tf.convert_to_tensor(v) if isinstance(v, tf.IndexedSlices) else v for v in values]
    pre, post = 1.0, 1.0
    if gradient_predivide_factor != 1.0:
        if op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor only applies to op=Average.")
        pre, post = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    reduced = reduce_compressed(values, op, compression, pre, post, name)
    out = list(grads)
    for index, value in zip(present, reduced, strict=True):
        out[index] = value
    return out


def reduce_compressed(
    tensors: Sequence[Any], op: ReduceOp, compression: Any, pre: float, post: float, name: Any
) -> list[Any]:
    """`grouped_allreduce` of `tensors` as `compression` sends them (sparse ones as they
    are)."""
    packed = [
        (t, None)
        if isinstance(t, tf.IndexedSlices)
        else compression.compress(tf.convert_to_tensor(t))
        for t in tensors
    ]
    reduced = grouped_allreduce(
        [c for c, _ in packed], op, name=name, prescale_factor=pre, postscale_factor=post
    )
    return [
        r if isinstance(r, tf.IndexedSlices) else compression.decompress(r, ctx)
        for r, (_, ctx) in zip(reduced, packed, strict=True)
    ]


def _source_key(source: Any) -> Any:
    """A hashable identity for a variable (a Keras variable's is its TF variable's)."""
    source = _backend_variable(source)
    return source.ref() if hasattr(source, "ref") else id(source)


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose `gradient()` returns gradients averaged over every rank.

    The gradients are reduced as one grouped request (`reduce_gradients`), eagerly and
    inside ``tf.function`` alike; ``tf.IndexedSlices`` (embeddings) are gathered, or
    densified with `sparse_as_dense`. Gradients of local variables stay on this rank
    (each rank trains its own copy of those), divided by the number of ranks with
    `scale_local_gradients`. Every other attribute is the tape's. A tape made inside a
    process set's scope reduces among the set's ranks, wherever `gradient()` is called.

    Args:
        tape: the tape to wrap. Defaults to None: a new ``tf.GradientTape(**tape_kwargs)``.
        op: `Average` (default) or `Sum`.
        compression: `Compression.none` (default) or `Compression.fp16`.
        sparse_as_dense: reduce ``tf.IndexedSlices`` as dense tensors. Defaults to False.
        gradient_predivide_factor: see `reduce_gradients`. Defaults to 1.
        local_variables: variables whose gradients are not reduced. Defaults to none.
        scale_local_gradients: divide local gradients by the number of ranks. Defaults
            to True.
        **tape_kwargs: ``tf.GradientTape``'s arguments, when `tape` is None.

    Example:
        >>> with rtf.DistributedGradientTape() as tape:  # doctest: +SKIP
        ...     loss = loss_fn(labels, model(images, training=True))
        >>> grads = tape.gradient(loss, model.trainable_variables)
        >>> optimizer.apply_gradients(zip(grads, model.trainable_variables))
    """

    def __init__(
        self,
        tape: tf.GradientTape | None = None,
        *,
        op: ReduceOp | str = Average,
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        gradient_predivide_factor: float = 1.0,
        local_variables: Sequence[Any] = (),
        scale_local_gradients: bool = True,
        **tape_kwargs: Any,
    ) -> None:
        self._tape = tape if tape is not None else tf.GradientTape(**tape_kwargs)
        self._op = as_op(op)
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._predivide = float(gradient_predivide_factor)
        self._local = {_source_key(v) for v in local_variables}
        self.scale_local_gradients = scale_local_gradients
        self._engine = runtime.scope.get()  # None: the world's

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def register_local_source(self, source: Any) -> None:
        """Keep `source`'s gradient on this rank (not reduced)."""
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
        """The tape's gradients of `target` for `sources`, reduced over every rank (local
        sources' kept here); the same structure as `sources`."""
        kwargs.pop("use_generic_names", None)
        token = runtime.scope.set(self._engine)
        try:
            return self._gradient(target, sources, output_gradients, **kwargs)
        finally:
            runtime.scope.reset(token)

    def _gradient(self, target: Any, sources: Any, output_gradients: Any, **kwargs: Any) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        local = [self._is_local(s) for s in flat_sources]
        shared = [None if is_local else g for g, is_local in zip(flat, local, strict=True)]
        reduced = self._reduce(shared)
        merged = [
            self._scaled_local(g) if is_local else r
            for g, r, is_local in zip(flat, reduced, local, strict=True)
        ]
        return tf.nest.pack_sequence_as(grads, merged)

    def _reduce(self, grads: list[Any]) -> list[Any]:
        """The shared gradients reduced over every rank (None stays None)."""
        return reduce_gradients(
            grads,
            self._op,
            compression=self._compression,
            sparse_as_dense=self._sparse_as_dense,
            gradient_predivide_factor=self._predivide,
        )

    def get_local_and_global_gradients(
        self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any
    ) -> tuple[list, list]:
        """([(local source, its gradient)], [(other source, its reduced gradient)])."""
        grads = self.gradient(target, sources, output_gradients)
        local, shared = [], []
        for g, s in zip(tf.nest.flatten(grads), tf.nest.flatten(sources), strict=True):
            (local if self._is_local(s) else shared).append((s, g))
        return local, shared
