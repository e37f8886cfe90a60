"""`SyncBatchNormalization`: Keras batch normalization with the statistics of every rank's
batch together (TensorFlow backend)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from .. import core
from ..core.ops import Sum
from .collectives import grouped_allreduce


@keras.saving.register_keras_serializable(package="ringplug")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Keras's BatchNormalization whose training-time mean and variance are those of the
    global batch (every rank's batch together), reduced with one allreduce per call; the
    moving statistics then agree on every rank. Takes BatchNormalization's arguments.

    Example:
        >>> model = keras.Sequential([keras.layers.Conv2D(32, 3),  # doctest: +SKIP
        ...                           rtf.SyncBatchNormalization(), keras.layers.ReLU()])
    """

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if mask is not None or core.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        # Sums in float32 at least: float16 sums of squares overflow.
        wide = tf.float32 if inputs.dtype in (tf.float16, tf.bfloat16) else inputs.dtype
        values = tf.cast(inputs, wide)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(values), axes)), wide)
        total, squares = tf.reduce_sum(values, axes), tf.reduce_sum(tf.square(values), axes)
        count, total, squares = grouped_allreduce([tf.reshape(count, [1]), total, squares], op=Sum)
        mean = total / count
        variance = tf.maximum(squares / count - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
