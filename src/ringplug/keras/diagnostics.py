"""RingDiagnose: the step-time breakdown and verdict of a Keras fit over every rank."""

from __future__ import annotations

import time
import warnings
from typing import Any

import keras
import numpy as np

from .. import core, diagnose
from ..config import diagnose_setting
from ..diagnose import Diagnosis, StepClock


class RingDiagnose(keras.callbacks.Callback):
    """Measures where each rank's training steps go and names the bottleneck.

    Per rank and step: the wait for the batch (until it reaches the train step: from the
    step's start on TensorFlow, which fetches inside the step; from the end of the previous
    step on torch, which fetches between steps), forward and backward, the gradient reduction of
    `DistributedOptimizer` (Keras reduces after the whole backward, so all of it is
    exposed), and the rest of the step (the update, metrics). At the end of fit rank 0
    prints each rank's medians and one verdict line (data-bound, straggler,
    communication-bound or compute-bound, with what to do); every rank's epoch medians
    are added to the epoch's logs (``ringplug_rank1_data_ms``, ``..._data_share``), so
    ``CSVLogger``, ``TensorBoard`` and ``History`` record them: list RingDiagnose before
    those callbacks. With a timeline recording, every rank's steps go on its own track.
    TensorFlow and torch backends, on CPUs (JAX and GPU reductions are not measured yet).
    ``RINGPLUG_DIAGNOSE=0`` turns it off without editing the script.

    Args:
        every_n_steps: also print a report every this many steps. Defaults to ``None``
            (``RINGPLUG_DIAGNOSE_EVERY``, else only at the end of fit).
        epoch_logs: add the epoch's medians to the epoch logs (one collective per epoch).
            Defaults to True.

    Example:
        >>> model.fit(data, callbacks=[ringplug.keras.RingBroadcast(0),  # doctest: +SKIP
        ...                            ringplug.keras.RingDiagnose(),
        ...                            keras.callbacks.CSVLogger("log.csv")])
    """

    def __init__(self, every_n_steps: int | None = None, epoch_logs: bool = True) -> None:
        super().__init__()
        self.every_n_steps = every_n_steps
        self.epoch_logs = epoch_logs
        self.clock: StepClock | None = None
        self.diagnosis: Diagnosis | None = None  # the last report (the same on every rank)
        self._epoch_start = 0
        self._fetches_inside = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        core.init()
        enabled, every = diagnose_setting()
        self.clock = None
        if enabled is False or core.size() == 1:
            return
        backend = keras.backend.backend()
        if backend not in ("tensorflow", "torch"):
            warnings.warn(
                f"ringplug: RingDiagnose measures the tensorflow and torch backends, "
                f"not {backend!r}; this fit is not measured.",
                stacklevel=2,
            )
            return
        self._fetches_inside = backend == "tensorflow"
        self.clock = StepClock(self.every_n_steps or every)
        _mark_arrivals(self.model, backend)
        self.clock.start()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.clock is not None:
            self._epoch_start = self.clock.steps

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.clock is not None and self._fetches_inside:
            # TensorFlow fetches the batch inside the train function called next: the time
            # since the last step's end went to Keras's callbacks, not to the data.
            self.clock.fetch_began = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.clock is not None:
            self.clock.step_ended()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        clock = self.clock
        if clock is None or not self.epoch_logs or logs is None:
            return
        rows = clock.recent(clock.steps - self._epoch_start)
        self.diagnosis = clock.report(rows, final=False, show=False)
        logs.update(self.diagnosis.metrics(separator="_"))

    def on_train_end(self, logs: dict | None = None) -> None:
        clock, self.clock = self.clock, None
        if clock is None:
            return
        _unmark_arrivals(self.model)
        self.diagnosis = clock.finish()


def _arrived(*_: Any) -> np.int64:
    """The batch is in the train step: the data wait ends and compute begins."""
    clock = diagnose.active()
    if clock is not None:
        clock.fetched(time.perf_counter())
    return np.int64(0)


def _mark_arrivals(model: keras.Model, backend: str) -> None:
    """Make the model's train step say when its batch has arrived, then rebuild it."""
    if "train_step" in vars(model):
        return  # already marked (a second RingDiagnose, or a fit that failed)
    original = model.train_step

    if backend == "tensorflow":
        import tensorflow as tf

        def train_step(data: Any) -> Any:
            leaves = [t for t in tf.nest.flatten(data) if t is not None]
            if not leaves:
                return original(data)
            # Stateful and fed by the batch: runs when the batch is there, in program order
            # with the (stateful) gradient reduction.
            token = tf.numpy_function(
                _arrived,
                [tf.size(leaves[0])],
                tf.int64,
                stateful=True,
                name="ringplug_batch_arrived",
            )
            with tf.control_dependencies([token]):
                data = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), data)
            return original(data)
    else:

        def train_step(data: Any) -> Any:
            _arrived()
            return original(data)

    object.__setattr__(model, "train_step", train_step)
    model.make_train_function(force=True)


def _unmark_arrivals(model: keras.Model) -> None:
    if "train_step" in vars(model):
        object.__delattr__(model, "train_step")
        model.train_function = None  # the next fit builds the plain step again
