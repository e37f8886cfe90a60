"""`RingSchedule`: a learning-rate schedule by epoch that Keras sets at every batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from .callbacks import set_learning_rate


class RingSchedule(keras.callbacks.Callback):
    """A learning-rate schedule by epoch, set per batch: LR = ``initial_lr *
    multiplier(epoch)`` during epochs [start_epoch, end_epoch) (Horovod's schedule callback).

    `multiplier` is a function of the epoch, or a number ``m`` meaning exponential decay,
    ``m ** (epoch - start_epoch)``. With `staircase` the LR is set at the first batch of
    each epoch (the function sees whole epochs), otherwise at every batch (it sees
    ``epoch + batch / steps_per_epoch``). Outside the epochs the LR is left alone, so
    several schedules (and a `RingWarmup` before them) can cover consecutive epochs. Unlike
    ``keras.callbacks.LearningRateScheduler`` it can change the LR within an epoch and
    keeps SGD's momentum consistent with the new LR.

    Args:
        initial_lr: the LR the multiplier scales (required).
        multiplier: a number or a function of the (fractional) epoch.
        start_epoch: first epoch of the schedule. Defaults to 0.
        end_epoch: the epoch it stops before. Defaults to None (never).
        staircase: change the LR once per epoch. Defaults to True.
        momentum_correction: rescale SGD's momentum slots by new/old LR. Defaults to True.
        steps_per_epoch: batches per epoch (only without staircase). Defaults to what
            ``fit`` knows.

    Example:
        >>> model.fit(x, y, epochs=30, callbacks=[  # doctest: +SKIP
        ...     rk.RingWarmup(warmup_epochs=5),
        ...     rk.RingSchedule(rk.scale_lr(0.1), multiplier=0.1, start_epoch=15)])
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
        if initial_lr is None:
            raise ValueError(
                f"{type(self).__name__} needs initial_lr (the LR that multiplier scales)."
            )
        self.initial_lr = initial_lr
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            params = self.params or {}
            steps = params.get("steps")
            if not steps and params.get("samples") and params.get("batch_size"):
                steps = params["samples"] // params["batch_size"]
            if not steps:
                raise ValueError(
                    f"{type(self).__name__}(staircase=False) needs "
                    "steps_per_epoch= (fit does not know it for this data)."
                )
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust(epoch)
        else:
            self._adjust(epoch + batch / self.steps_per_epoch)

    def _adjust(self, epoch: float) -> None:
        lr = self.initial_lr * self.multiplier(epoch)
        set_learning_rate(self.model.optimizer, lr, self.momentum_correction)
