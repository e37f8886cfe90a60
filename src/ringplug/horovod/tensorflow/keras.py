"""``import ringplug.horovod.tensorflow.keras as hvd``: the same module as
``ringplug.horovod.keras``."""

import sys

from .. import keras as _keras

sys.modules[__name__] = _keras
