"""Elastic state for TensorFlow 2 trainings that ringrun restarts (``ringrun --max-restarts
N``, ``--min-np``): `TensorFlowState` (variables and counters) and `run`, the decorator
that resumes a training function from the newest commit, eagerly. Horovod's
``horovod.tensorflow.elastic`` (`ringplug.horovod.tensorflow.elastic`) is these, with
``TensorFlowKerasState`` (`ringplug.keras.elastic.KerasState`) for Keras models.

Example::

    from ringplug.tensorflow import elastic

    @elastic.run
    def train(state):
        start_batch = state.batch
        for batch_idx, (images, labels) in enumerate(dataset.skip(state.batch).take(steps)):
            state.batch = start_batch + batch_idx
            training_step(images, labels)  # with ringplug.tensorflow.DistributedGradientTape
            state.commit()

    state = elastic.TensorFlowState(model.variables + optimizer.variables, batch=0)
    state.register_reset_callbacks([lambda: optimizer.learning_rate.assign(lr * rtf.size())])
    train(state)

Run it as ``ringrun -np 3 --min-np 2 --max-restarts 2 python train.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from ..core.errors import RingplugError
from ..elastic import HostsUpdatedInterrupt, ObjectState, State, check_commit_fits
from ..elastic import run as run_fn
from .collectives import _backend_variable as backend_variable
from .collectives import broadcast_variables

__all__ = [
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TensorFlowState",
    "run",
]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function ``func(state, ...)``: on a restart it resumes from the
    last commit (calling the reset callbacks when the number of ranks changed), then every
    rank gets rank 0's state, then `func` runs. A lost peer (ringplug's error, or the
    ``tf.errors.FailedPreconditionError`` a collective raises inside a ``tf.function``) ends
    the rank with its error, and ``ringrun --max-restarts N`` restarts the job."""
    return run_fn(func, failures=(RingplugError, tf.errors.FailedPreconditionError))


class TensorFlowState(ObjectState):
    """State of TensorFlow variables for elastic jobs, eagerly (TensorFlow 2): the values of
    `variables`, and any other keyword argument, kept as attributes (``state.batch``).

    `commit()` copies the variables' values (and, in an elastic ringrun job, writes them to
    disk), `restore()` assigns them back, `sync()` broadcasts rank 0's in place. Keras
    variables (``model.trainable_variables``) are taken too. A commit is only restored into
    variables of the same count and shapes (else ``ValueError``).

    Args:
        variables: the ``tf.Variable`` objects to keep. Defaults to None:
            ``tf.compat.v1.global_variables()``, as Horovod, which is empty eagerly.
        session: Horovod's TF1 session argument; must stay None (TF1 graphs are refused).
        **kwargs: more state, e.g. ``batch=0, epoch=0``.

    Raises:
        NotImplementedError: in a TF1 graph (not executing eagerly), or given a session.

    Example::

        weights = [tf.Variable(tf.zeros([4, 2])), tf.Variable(tf.zeros([2]))]
        state = elastic.TensorFlowState(weights, batch=0)
        state.commit()
    """

    def __init__(
        self, variables: Sequence[tf.Variable] | None = None, session: Any = None, **kwargs: Any
    ) -> None:
        if session is not None or not tf.executing_eagerly():
            raise NotImplementedError(
                "TensorFlowState works eagerly (TensorFlow 2) only; ringplug has no "
                "elastic state for TF1 graphs and sessions. Keep a tf.compat.v1.train.Saver "
                "checkpoint and restore it at start under ringrun --max-restarts N, or run the "
                "training eagerly."
            )
        self.variables = list(variables) if variables else tf.compat.v1.global_variables()
        self.session = None
        super().__init__(**kwargs)

    def _described(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(v.name, tuple(v.shape)) for v in self.variables]

    def _snapshot(self) -> dict[str, Any]:
        values = [backend_variable(v).numpy() for v in self.variables]
        return {"variables": (self._described(), values), "objects": super()._snapshot()}

    def _apply(self, snapshot: dict[str, Any]) -> None:
        described, values = snapshot["variables"]
        check_commit_fits("variables", self._described(), described)
        for variable, value in zip(self.variables, values, strict=True):
            backend_variable(variable).assign(value)
        super()._apply(snapshot["objects"])

    def sync(self) -> None:
        """Give every rank rank 0's state: the variables broadcast in place, the other
        values as one object; then save it."""
        if self.variables:
            broadcast_variables([backend_variable(v) for v in self.variables], root_rank=0)
        super()._apply(self._bcast_object(super()._snapshot()))
        self.save()
