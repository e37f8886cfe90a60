"""``hvd.elastic`` of ``ringplug.horovod.keras`` (also ``ringplug.horovod.tensorflow.keras``):
Horovod's elastic Keras API, which is `ringplug.keras.elastic` (`KerasState`, the state
callbacks, `run`), on ringrun's restarts. Horovod's ``tensorflow2_keras_mnist_elastic.py``
runs as it is under ``ringrun -np 3 --min-np 2 --max-restarts 2 python train.py``.
"""

from __future__ import annotations

from typing import Any

import keras

from ...keras import elastic as _elastic
from ...keras.elastic import *  # noqa: F403 - Horovod's names are ringplug's

__all__ = [*_elastic.__all__, "TensorFlowKerasState"]


class TensorFlowKerasState(_elastic.KerasState):
    """`KerasState` under the name ``horovod.tensorflow`` gives it; `backend` (Horovod's TF1
    Keras backend) is accepted and unused: Keras 3 has no session to take values from."""

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | None = None,
        backend: Any = None,
        **kwargs: Any,
    ) -> None:
        self.backend = backend
        super().__init__(model, optimizer=optimizer, **kwargs)
