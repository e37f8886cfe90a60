"""Horovod's Keras callbacks under their Horovod names, working on Keras 3, with
Horovod's schedules: the same learning rate at every batch as Horovod's callbacks give."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras

from ... import core
from ...keras.callbacks import RingBroadcast, RingMetricAverage, RingWarmup
from ...keras.optimizer import backend_variable
from ...keras.schedule import RingSchedule


class _LogsLearningRate(keras.callbacks.Callback):
    """Writes each epoch's learning rate to ``logs["lr"]``, as Horovod's LR callbacks do."""

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        optimizer = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class BroadcastGlobalVariablesCallback(RingBroadcast):
    """Root's model weights and optimizer state to every rank at the start of training.

    Args:
        root_rank: the rank whose state everyone starts from.
        device: accepted for Horovod compatibility; unused.
        local_variables: variables each rank keeps its own value of (not broadcast).
    """

    def __init__(
        self, root_rank: int, device: str = "", local_variables: Iterable[Any] | None = None
    ) -> None:
        super().__init__(root_rank)
        self.local_variables = list(local_variables or [])

    def _state_variables(self) -> list[Any]:
        # By what holds the value: a Keras variable and its backend variable are one.
        local = {id(backend_variable(v)) for v in self.local_variables}
        return [v for v in super()._state_variables() if id(backend_variable(v)) not in local]


class MetricAverageCallback(RingMetricAverage):
    """Average the epoch's metrics over ranks (put it before callbacks that read them)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()


class LearningRateScheduleCallback(_LogsLearningRate, RingSchedule):
    """Horovod's name for `ringplug.keras.RingSchedule` (same arguments); the LR of each
    epoch is written to ``logs["lr"]``, as Horovod's callback does."""


class LearningRateWarmupCallback(_LogsLearningRate, RingWarmup):
    """Gradual warmup from ``initial_lr / size`` to `initial_lr` (None: the optimizer's LR)
    over `warmup_epochs`, per batch, on Horovod's curve (see `ringplug.keras.RingWarmup`);
    the LR of each epoch is written to ``logs["lr"]``."""

    def __init__(
        self,
        initial_lr: float | None,
        warmup_epochs: float = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__(warmup_epochs, initial_lr, momentum_correction, steps_per_epoch, verbose)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model with the best `monitor` value seen so far, on rank 0 only.

    Args:
        monitor: the metric to watch. Defaults to ``"val_loss"``.
        verbose: Keras's. Defaults to 0.
        save_weights_only: save only the weights. Defaults to False.
        mode: ``"auto"``, ``"min"`` or ``"max"``. Defaults to ``"auto"``.
        save_freq: ``"epoch"`` or a number of batches. Defaults to ``"epoch"``.
        filepath: where to save (Keras 3 wants a ``.keras`` file, or ``.weights.h5`` with
            `save_weights_only`). Required.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        filepath: str | None = None,
    ) -> None:
        if filepath is None:
            raise ValueError(
                "BestModelCheckpoint needs filepath= on Keras 3, e.g. filepath='best.keras'."
            )
        super().__init__(
            filepath,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )

    def _save_model(self, *args: Any, **kwargs: Any) -> None:
        if core.rank() == 0:  # the ranks hold the same model; one file
            super()._save_model(*args, **kwargs)
