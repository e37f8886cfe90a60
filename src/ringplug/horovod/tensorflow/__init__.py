"""``horovod.tensorflow`` where it is cheap: ``import ringplug.horovod.tensorflow as hvd``
gives the same basics, collectives and ``broadcast_variables`` as ``ringplug.horovod.keras``
(TensorFlow tensors in and out), `BroadcastGlobalVariablesHook` for ``tf.compat.v1``
MonitoredTrainingSession code, and ``hvd.keras`` for Keras scripts."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .._common import check_process_set, global_process_set
from ..keras import *  # noqa: F403 - the same API
from ..keras import __all__ as _keras_all
from . import keras


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """When the session is created, every rank's global variables get root's values (for
    ``tf.compat.v1.train.MonitoredTrainingSession(hooks=[...])``)."""

    def __init__(self, root_rank: int, device: str = "",
                 process_set: Any = global_process_set) -> None:  # fmt: skip
        check_process_set(process_set)
        self.root_rank = root_rank

    def after_create_session(self, session: Any, coord: Any) -> None:
        import numpy as np

        from ... import core

        variables = tf.compat.v1.global_variables()
        for index, (variable, value) in enumerate(zip(variables, session.run(variables),
                                                      strict=True)):  # fmt: skip
            array = np.array(value, copy=True).reshape(-1)  # 0-d values too
            core.broadcast(array, self.root_rank, out=array, name=f"hook.{index}")
            variable.load(array.reshape(np.shape(value)), session)


__all__ = [*_keras_all, "BroadcastGlobalVariablesHook", "keras"]
