"""Horovod's Keras callbacks under their Horovod names, working on Keras 3."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from ...keras.callbacks import (
    RingBroadcast,
    RingMetricAverage,
    RingWarmup,
    set_learning_rate,
)


class BroadcastGlobalVariablesCallback(RingBroadcast):
    """Root's model weights and optimizer state to every rank at the start of training."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__(root_rank)


class MetricAverageCallback(RingMetricAverage):
    """Average the epoch's metrics over ranks (put it before callbacks that read them)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()


class LearningRateWarmupCallback(RingWarmup):
    """Gradual warmup from ``initial_lr / size`` to `initial_lr` over `warmup_epochs`."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: float = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__(warmup_epochs, initial_lr, momentum_correction, steps_per_epoch, verbose)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """LR = ``initial_lr * multiplier`` during epochs [start_epoch, end_epoch).

    `multiplier` is a number or a function of the epoch. With `staircase` the LR changes at
    epoch starts (the function sees whole epochs), otherwise at every batch (it sees
    fractional epochs; needs `steps_per_epoch` or a ``fit`` that knows it).
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda _: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def _active(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _apply(self, epoch: float) -> None:
        if self._active(epoch):
            lr = self.initial_lr * self.multiplier(epoch)
            set_learning_rate(self.model.optimizer, lr, self.momentum_correction)

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    "LearningRateScheduleCallback(staircase=False) needs steps_per_epoch."
                )

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch
        if self.staircase:
            self._apply(epoch)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if not self.staircase:
            self._apply(self._epoch + batch / self.steps_per_epoch)
