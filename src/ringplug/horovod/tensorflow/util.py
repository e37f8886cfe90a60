"""``hvd.util``: the helpers Horovod's TensorFlow users (and its tests) reach for."""

from tensorflow import executing_eagerly as _executing_eagerly  # noqa: F401 - Horovod's name
