"""``hvd.elastic`` of ``ringplug.horovod.tensorflow``: Horovod's ``horovod.tensorflow.elastic``,
which is `ringplug.tensorflow.elastic` with the Keras state of
`ringplug.horovod.keras.elastic` (Horovod's ``tensorflow2_mnist_elastic.py`` runs as it is
under ``ringrun -np 3 --min-np 2 --max-restarts 2 python train.py``)."""

from ...tensorflow import elastic as _elastic
from ...tensorflow.elastic import *  # noqa: F403 - Horovod's names are ringplug's
from ..keras.elastic import TensorFlowKerasState

__all__ = [*_elastic.__all__, "TensorFlowKerasState"]
