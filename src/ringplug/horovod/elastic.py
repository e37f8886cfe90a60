"""Horovod's elastic API (``hvd.elastic``): ringplug's own (`ringplug.elastic`) under
Horovod's names, which the torch, Keras and TensorFlow modules build on (``torch_elastic``,
``keras.elastic``, ``tensorflow.elastic``)."""

from ..elastic import CommitStore, HostsUpdatedInterrupt, ObjectState, State, check_commit_fits
from ..elastic import run as run_fn

__all__ = [
    "CommitStore",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "check_commit_fits",
    "run_fn",
]
