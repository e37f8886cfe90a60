"""Elastic state for Keras 3 trainings that ringrun restarts (``ringrun --max-restarts N``,
``--min-np``): `KerasState` (a model, its optimizer, counters), the callbacks that commit it
during ``fit``, and `run`, the decorator that resumes a training function from the newest
commit. Horovod's ``hvd.elastic`` for Keras (`ringplug.horovod.keras.elastic`) is these.

How a job resumes: the newest commit is restored, the reset callbacks run when the number
of ranks changed, and every rank gets rank 0's state (`State` in
`ringplug.elastic`, shared with torch).

Backends: the state and the callbacks use only Keras 3's own API (``get_weights``,
``optimizer.variables``, ``Variable.assign``, ``model.stop_training``), so they run on the
TensorFlow, torch and JAX backends alike (on JAX a commit first asks the model for the
values its ``fit`` is training); ringplug tests them under ``ringrun`` on TensorFlow. A
commit is made at the end of a batch, outside the compiled step.

Example::

    from ringplug.keras import elastic

    state = elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([on_state_reset])
    callbacks = [
        elastic.UpdateEpochStateCallback(state),
        elastic.UpdateBatchStateCallback(state),
        elastic.CommitStateCallback(state, batches_per_commit=10),
    ]

    @elastic.run
    def train(state):
        state.model.fit(dataset, steps_per_epoch=500 // ringplug.size(),
                        epochs=24 - state.epoch, callbacks=callbacks)

    train(state)

Run it as ``ringrun -np 3 --min-np 2 --max-restarts 2 python train.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from ..elastic import HostsUpdatedInterrupt, ObjectState, State, check_commit_fits
from ..elastic import run as run_fn
from ._reduce import broadcast_variables
from .sharding import is_sharded

__all__ = [
    "CommitStateCallback",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "State",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function ``func(state, ...)``: on a restart it resumes from the
    last commit (calling the reset callbacks when the number of ranks changed), then every
    rank gets rank 0's state, then `func` runs. A lost peer ends the rank with its error,
    and ``ringrun --max-restarts N`` restarts the job."""
    failures: tuple[type[BaseException], ...] = ()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        # What a ringplug collective's failure is inside a TensorFlow graph.
        failures = (tf.errors.FailedPreconditionError,)
    from ..core.errors import RingplugError

    return run_fn(func, failures=(RingplugError, *failures))


def _variables_of(value: Any) -> list[Any] | None:
    """The Keras variables that hold `value`'s state, or None for a plain value: a layer's
    or model's weights (``get_weights()``'s), an optimizer's variables (its step count,
    learning rate and slots), a variable itself."""
    if isinstance(value, keras.layers.Layer):
        return list(value.weights)
    if isinstance(value, keras.optimizers.Optimizer):
        return list(value.variables)
    if isinstance(value, keras.Variable):
        return [value]
    return None


def _described(variables: list[Any]) -> list[tuple[str, tuple[int, ...]]]:
    return [(getattr(v, "path", v.name), tuple(v.shape)) for v in variables]


class KerasState(ObjectState):
    """State of a Keras 3 training for elastic jobs: a model's weights, its optimizer's
    variables, and any other keyword argument, kept as attributes (``state.model``,
    ``state.optimizer``, ``state.epoch``).

    `commit()` copies the values (``model.get_weights()`` and ``optimizer.variables``: the
    step count, the learning rate, the slots) and, in an elastic ringrun job, writes them
    to disk; `restore()` assigns them back into the same objects; `sync()` broadcasts rank
    0's in place. A keyword value that is a Keras layer, optimizer or ``keras.Variable`` is
    kept the same way; other values are kept as they are (they must pickle).

    An optimizer has no slot variables until it is built (by its first step): an unbuilt
    `optimizer` is built here, with ``model.trainable_variables``, so that every commit has
    all of its variables and a restarted job, whose optimizer has not stepped yet, can take
    them. A commit is only restored into the same architecture: other variable counts or
    shapes raise ``ValueError`` naming the first difference.

    Args:
        model: a built Keras model (``model.build(input_shape)``, or called once).
        optimizer: its optimizer (e.g. ``rk.DistributedOptimizer(...)``). Defaults to None:
            ``model.optimizer`` if the model is compiled, else no optimizer state.
        **kwargs: more state, e.g. ``epoch=0, batch=0``.

    Example::

        model.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                      loss="sparse_categorical_crossentropy")
        model.build((None, 28, 28, 1))
        state = elastic.KerasState(model, batch=0, epoch=0)
        state.commit()
    """

    def __init__(
        self, model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None, **kwargs: Any
    ) -> None:
        if not getattr(model, "built", False):
            raise ValueError(
                "KerasState: the model is not built, so it has no weights to keep "
                "yet. Build it first: model.build(input_shape), give a Sequential a "
                "keras.Input, or train one step (as Horovod's examples do)."
            )
        if optimizer is None:
            optimizer = getattr(model, "optimizer", None)
        if any(is_sharded(o) for o in (optimizer, *kwargs.values())):
            raise ValueError(
                "KerasState cannot keep a zero=1 (sharded) optimizer: each rank holds only "
                "its share of the state, and after the ranks change the shares are dealt "
                "anew. Use zero=0 in elastic jobs, or ringplug.keras.BackupAndRestore, which "
                "resumes a sharded fit on another number of ranks."
            )
        if isinstance(optimizer, keras.optimizers.Optimizer) and not optimizer.built:
            optimizer.build(model.trainable_variables)
        for name, value in kwargs.items():
            if isinstance(value, keras.optimizers.Optimizer) and not value.built:
                raise ValueError(
                    f"KerasState: the optimizer {name}= is not built, so its slot "
                    "variables do not exist yet. Build it with the variables it trains "
                    f"({name}.build(variables)) before making the state."
                )
        super().__init__(model=model, optimizer=optimizer, **kwargs)

    def _snapshot(self) -> dict[str, tuple[str, Any]]:
        for name in self._names:
            # JAX's fit trains copies of the variables and leaves the model's empty until
            # something asks for them: a commit at a batch's end does.
            sync_from_jax = getattr(getattr(self, name), "jax_state_sync", None)
            if callable(sync_from_jax):
                sync_from_jax()
        snapshot: dict[str, tuple[str, Any]] = {}
        for name in self._names:
            value = getattr(self, name)
            variables = _variables_of(value)
            if variables is None:
                snapshot[name] = ("value", value)
            else:
                values = [keras.ops.convert_to_numpy(v) for v in variables]
                snapshot[name] = ("variables", (_described(variables), values))
        return snapshot

    def _apply(self, snapshot: dict[str, tuple[str, Any]]) -> None:
        # Every variable checked before any is assigned: a commit that does not fit changes
        # nothing.
        for name, (kind, saved) in snapshot.items():
            if kind == "variables":
                variables = _variables_of(getattr(self, name))
                if variables is None:
                    raise ValueError(
                        f"elastic: the commit holds Keras variables for state.{name}, which "
                        f"is now {type(getattr(self, name)).__name__}; a restarted job must "
                        "make the same state as the job that committed."
                    )
                check_commit_fits(name, _described(variables), saved[0])
        for name, (kind, saved) in snapshot.items():
            if kind == "variables":
                variables = _variables_of(getattr(self, name))
                for variable, value in zip(variables, saved[1], strict=True):
                    variable.assign(value)
            else:
                setattr(self, name, saved)

    def sync(self) -> None:
        """Give every rank rank 0's state: the Keras variables broadcast in place (one
        broadcast per dtype), the other values as one object; then save it."""
        variables: list[Any] = []
        rest: dict[str, tuple[str, Any]] = {}
        for name in self._names:
            value = getattr(self, name)
            held = _variables_of(value)
            if held is None:
                rest[name] = ("value", value)
            else:
                variables.extend(held)
        if variables:
            broadcast_variables(variables, 0, name="keras.elastic")
        self._apply(self._bcast_object(rest))
        self.save()


class CommitStateCallback(keras.callbacks.Callback):
    """Commit the elastic `state` every `batches_per_commit` batches and at each epoch's end.

    Put it after `UpdateEpochStateCallback` and `UpdateBatchStateCallback` (as Horovod's
    example does), so that a commit holds the epoch and batch it was made at. A commit
    copies the model and optimizer and, on each host's first rank, writes them to disk: on
    a large model commit every few hundred batches (see docs/horovod.md for the cost).

    Args:
        state: the `KerasState` (or any `State`) to commit.
        batches_per_commit: batches between two commits. Defaults to 1.

    Example::

        model.fit(dataset, epochs=5,
                  callbacks=[elastic.UpdateEpochStateCallback(state),
                             elastic.UpdateBatchStateCallback(state),
                             elastic.CommitStateCallback(state, batches_per_commit=100)])
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(
                f"batches_per_commit must be 1 or more, got {batches_per_commit}; the epoch's "
                "end is always committed too."
            )
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    # Overridden (not on_batch_end) and not async_safe: Keras must call it in the training
    # thread, between two steps, or the commit would copy weights a later step is changing.
    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the batch of the epoch being trained, and after a resume,
    finish the interrupted epoch instead of training all of it again.

    At each batch's end ``state.batch`` is set to that batch's index in the epoch; at the
    epoch's end to 0. When `fit` starts with ``state.batch`` > 0 (resumed from a commit
    made mid-epoch) and its epochs have a known number of steps, the first epoch is cut to
    the steps that are left (Horovod's behaviour: the committed batch is trained once more)
    and ``state.batch`` goes on counting from the committed one. The epoch is cut by
    ``model.stop_training``, reset at that epoch's end, so put this callback before any
    callback that stops training (``EarlyStopping``). Which samples the resumed epoch
    reads is the dataset's business (e.g. ``dataset.skip``), as in Horovod.

    Args:
        state: the state whose ``batch`` attribute is kept (``KerasState(..., batch=0)``).
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None
        self._resuming = False
        self._start = 0
        self._stop_after: int | None = None
        self._stopped = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.steps_per_epoch = None
        self._resuming = True

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._start = self.state.batch if self._resuming else 0
        self._resuming = False
        steps = (self.params or {}).get("steps")
        if steps and self.steps_per_epoch is None:
            self.steps_per_epoch = steps
        self._stop_after = max(1, steps - self._start) if steps and self._start > 0 else None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = self._start + batch
        if self._stop_after is not None and batch + 1 >= self._stop_after:
            self.model.stop_training = True
            self._stopped = True

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0
        self._stop_after = None
        if self._stopped:
            self.model.stop_training = False
            self._stopped = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs trained, across resumes.

    At each epoch's end ``state.epoch`` becomes the epoch the next one is: its value when
    `fit` began plus the epochs `fit` has trained. So ``fit(epochs=total - state.epoch)``
    (Horovod's example) and ``fit(initial_epoch=state.epoch, epochs=total)`` both count on
    from the commit.

    Args:
        state: the state whose ``epoch`` attribute is kept (``KerasState(..., epoch=0)``).
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch
        self._first_epoch: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch
        self._first_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._first_epoch is None:
            self._first_epoch = epoch  # fit's initial_epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        first = self._first_epoch if self._first_epoch is not None else epoch
        self.state.epoch = self.initial_epoch + (epoch - first) + 1
