"""``hvd.util``: the helpers Horovod's TensorFlow users (and its tests) reach for."""

from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (not inside a graph or ``tf.function``)."""
    return tf.executing_eagerly()
