"""Keras callbacks: start every rank from root's state, average epoch metrics, warm up the LR.

They communicate, so none of them is marked ``async_safe``: the torch and JAX backends then
run batch hooks in order on the training thread, as collectives need.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import keras
import numpy as np

from .. import core, diagnose
from ..core import activity
from . import _inputs
from ._reduce import broadcast_variables
from .agreement import check_agreement
from .optimizer import is_distributed, local_variable_keys, reduce_at_the_outermost, variable_key
from .sharding import consolidate, is_sharded, shared_variables


class RingBroadcast(keras.callbacks.Callback):
    """At the start of training, every rank gets root's model weights and optimizer state.

    Put it in every rank's ``fit(callbacks=...)``. The optimizer is built first if it is not
    yet; a model that only builds on its first batch is broadcast right after that batch.
    It warns once if the model's optimizer does not average gradients (ranks would drift
    apart), and moves the reduction outside a LossScaleOptimizer that ``compile()`` added.
    On TensorFlow, a model compiled with ``jit_compile=True`` trains without XLA (which
    cannot compile the reduction), with a warning.

    Non-trainable weights (BatchNorm's moving statistics) follow each rank's own batches;
    with `sync_statistics` root's are given to every rank again before each validation, at
    each epoch's end (for the callbacks after this one) and at the end of training, as DDP
    does with buffers, so every rank evaluates and saves the same model.

    While training it tells ringplug where the rank is (epoch, batch within it, and step:
    the optimizer's iterations), so a stall report names it: "rank 1 was in the train step
    at epoch 0, batch 3 (step 3) for 61 s"; and `bucketed_dataset` which epoch's order to
    take.

    At each epoch's end it checks that every rank holds bitwise the same weights and
    optimizer variables (a hash of each, one small collective), and raises
    `ringplug.keras.RanksDisagreeError` on every rank, naming the first variable that
    differs and which ranks hold which value, when they drift apart. Variables a rank keeps
    as its own (`PartialDistributedOptimizer`'s local layers, non-trainable weights when
    `sync_statistics` is off) are left out, and an optimizer that does not average is not
    checked.

    A ``keras.callbacks.BackupAndRestore`` in the same callbacks becomes
    `ringplug.keras.BackupAndRestore` (rank 0 writes, every rank restores, mid-epoch
    included), and restores here, before the other ranks are given root's state.

    Args:
        root_rank: the rank whose state everyone starts from. Defaults to 0.
        sync_statistics: re-broadcast non-trainable weights before validation, at epoch
            ends and at the end. Defaults to True.
        check_agreement: when to check that the ranks hold the same weights: ``"epoch"``
            (default: at each epoch's end; one read of the weights and optimizer variables
            on the host, about 12 ms per 100 MB), a number of batches, or None (never).
    """

    def __init__(
        self,
        root_rank: int = 0,
        sync_statistics: bool = True,
        check_agreement: str | int | None = "epoch",
    ) -> None:
        super().__init__()
        if not (
            check_agreement in (None, "epoch")
            or (isinstance(check_agreement, int) and check_agreement > 0)
        ):
            raise ValueError(
                f"RingBroadcast: check_agreement={check_agreement!r}; give 'epoch', a "
                "positive number of batches, or None to check never."
            )
        self.root_rank = root_rank
        self.sync_statistics = sync_statistics
        self.check_agreement = check_agreement
        self._done = False
        self._epoch = 0
        self._epoch_start = 0  # the step the epoch began at
        self._steps = 0  # steps done: the optimizer's iterations

    def on_train_begin(self, logs: dict | None = None) -> None:
        from .backup import adopt_keras_backups

        core.init()
        _inputs.fit_began(self.params)
        model = self.model
        reduce_at_the_outermost(model)
        restored = False
        for backup in adopt_keras_backups(self):
            if backup._ringplug_restored_for is not self.params:
                restored |= backup.restore()  # every rank now holds root's restored state
        if keras.backend.backend() == "tensorflow" and getattr(model, "jit_compile", False):
            # XLA cannot compile the reduction op (a host callback): train without XLA.
            warnings.warn(
                "ringplug: XLA cannot compile the gradient reduction, so the train "
                "step runs with jit_compile=False (compile(jit_compile=False) "
                "silences this).",
                stacklevel=2,
            )
            model.jit_compile = False
            model.make_train_function(force=True)
        if core.size() > 1 and not is_distributed(model.optimizer):
            message = (
                "ringplug: the model's optimizer is not a ringplug.keras."
                "DistributedOptimizer, so gradients are not averaged and the ranks "
                "will drift apart. compile(optimizer=ringplug.keras."
                "DistributedOptimizer(...))."
            )
            warnings.warn(message, stacklevel=2)
            logging.getLogger("ringplug").warning(message)
        self._done = restored
        if model.built and model.weights and not restored:
            self._broadcast()
        self._steps = _iterations(model.optimizer)  # root's: a resumed fit counts on

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        _inputs.epoch_began(epoch)
        self._epoch, self._epoch_start = epoch, self._steps
        activity.set_position(epoch=epoch, step=self._steps)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        activity.set_position(epoch=self._epoch, batch=batch, step=self._epoch_start + batch)
        if diagnose.active() is None:  # else RingDiagnose's clock names the phases
            activity.set_phase(activity.IN_TRAIN_STEP)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # `batch` is the last of the steps run (steps_per_execution runs several at once).
        done_before = self._steps
        self._steps = self._epoch_start + batch + 1
        if diagnose.active() is None:
            activity.set_phase(activity.BETWEEN_STEPS)
        if not self._done:
            self._broadcast()  # the model built itself on its first batch
        every = self.check_agreement
        # steps_per_execution runs several batches at once: check when a multiple is passed.
        if isinstance(every, int) and self._steps // every > done_before // every:
            self._check_agreement(f"at step {self._steps}")

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._sync_statistics()  # fit's validation: every rank evaluates root's statistics

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._sync_statistics()  # for the epoch-end callbacks after this one
        if self.check_agreement == "epoch":
            self._check_agreement(f"at the end of epoch {epoch}")

    def on_train_end(self, logs: dict | None = None) -> None:
        self._sync_statistics()
        activity.set_position()  # this fit's position ends with it
        _inputs.fit_ended()

    def _sync_statistics(self) -> None:
        statistics = list(self.model.non_trainable_weights)
        if self.sync_statistics and self._done and statistics and core.size() > 1:
            broadcast_variables(statistics, self.root_rank, name="keras.statistics")

    def _broadcast(self) -> None:
        model = self.model
        optimizer = model.optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        broadcast_variables(self._state_variables(), self.root_rank)
        self._done = True

    def _state_variables(self) -> list[Any]:
        """What root gives every rank: the model's weights and the optimizer's variables
        (a sharded optimizer's slots stay each rank's own)."""
        return list(self.model.weights) + shared_variables(self.model.optimizer)

    def _check_agreement(self, where: str) -> None:
        # An optimizer that does not average lets the ranks drift apart (warned at start).
        if not self._done or core.size() == 1 or not is_distributed(self.model.optimizer):
            return
        sync_from_jax = getattr(self.model, "jax_state_sync", None)
        if callable(sync_from_jax):  # JAX trains copies; the model's may be stale
            sync_from_jax()
        check_agreement(self._agreed_variables(), where=where)

    def _agreed_variables(self) -> list[Any]:
        """What must stay the same on every rank: the state root gave, less what each rank
        keeps as its own: local layers (their optimizer slots too) and, without
        `sync_statistics`, the statistics of each rank's batches."""
        model, optimizer = self.model, self.model.optimizer
        shared = {id(v) for v in self._state_variables()}
        optimizer_variables = {id(v) for v in getattr(optimizer, "variables", [])}
        local = local_variable_keys(optimizer)
        everything = list(model.weights) + list(getattr(optimizer, "variables", []))
        # A sharded optimizer's slots are each rank's own (left out of `shared`); its step
        # counter and LR are checked.
        narrower = len(shared) < len({id(v) for v in everything}) and not is_sharded(optimizer)
        own_slots = local or narrower
        left_out = set() if self.sync_statistics else {id(v) for v in model.non_trainable_weights}
        left_out |= {id(v) for v in _accumulators(optimizer)}  # each rank's own gradients
        return [
            v
            for v in everything
            if id(v) in shared
            and id(v) not in left_out
            and variable_key(v) not in local
            # Slot variables follow their variable's gradients, local ones included.
            and not (own_slots and id(v) in optimizer_variables)
        ]


def _accumulators(optimizer: Any) -> list[Any]:
    """The variables where `optimizer` (and the one a loss-scale optimizer wraps) sums the
    local gradients of the batches between two updates."""
    found: list[Any] = []
    while optimizer is not None:
        found.extend(getattr(optimizer, "_accumulated_gradients", None) or [])
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return found


def _iterations(optimizer: Any) -> int:
    """The steps `optimizer` has taken (0 before it is built)."""
    if optimizer is None or not getattr(optimizer, "built", False):
        return 0
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


class ConsolidateForCheckpoints(keras.callbacks.Callback):
    """On every rank, before rank 0's ModelCheckpoints: whenever one of them saves, the
    sharded (``zero=1``) optimizer state is gathered to rank 0 first, so that the file holds
    the whole state. `ringplug.keras.on_rank_zero` puts it in front of the ModelCheckpoints
    it is given; with an optimizer that is not sharded it does nothing.

    A checkpoint saves at each epoch's end (``save_freq="epoch"``) or every ``save_freq``
    batches; this callback counts the batches as ModelCheckpoint does, on every rank (the
    ModelCheckpoints of the other ranks are not run, only read).
    """

    def __init__(self, checkpoints: list[keras.callbacks.ModelCheckpoint]) -> None:
        super().__init__()
        self._at_epochs = any(c.save_freq == "epoch" for c in checkpoints)
        self._every = [c.save_freq for c in checkpoints if isinstance(c.save_freq, int)]
        self._seen = [0] * len(self._every)  # batches since each one's last save
        self._last_batch = -1

    def _sharded(self) -> bool:
        optimizer = getattr(self.model, "optimizer", None)
        return optimizer is not None and is_sharded(
            getattr(optimizer, "inner_optimizer", optimizer)
        )

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self._every:
            return
        # A batch number that did not grow is a new epoch's: it counts batch + 1.
        added = batch + 1 if batch <= self._last_batch else batch - self._last_batch
        self._last_batch = batch
        due = False
        for i, every in enumerate(self._every):
            self._seen[i] += added
            if self._seen[i] >= every:
                self._seen[i] = 0
                due = True
        if due and self._sharded():
            consolidate(self.model.optimizer, to=0)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self._at_epochs and self._sharded():
            consolidate(self.model.optimizer, to=0)


class RingMetricAverage(keras.callbacks.Callback):
    """Average the epoch's metrics in ``logs`` (training and validation) over every rank.

    Put it first in ``callbacks``: Keras hands one ``logs`` dict to the callbacks in order,
    so EarlyStopping, ReduceLROnPlateau and ModelCheckpoint placed after it decide on the
    averaged values, the same on every rank.

    The mean of the ranks' means is the global mean when every rank sees the same number of
    samples (what `shard` arranges) and the metric is a per-sample mean (loss, accuracy, MAE).
    It is not the global value for metrics that do not average: AUC, precision/recall, F1,
    or anything computed from a confusion matrix.
    """

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is None or core.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        everyone = core.allgather_object(keys, name="keras.metric-names")
        if any(other != keys for other in everyone):
            raise ValueError(
                f"RingMetricAverage: the ranks log different metrics: {dict(enumerate(everyone))}."
            )
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = core.allreduce(values, "average", name="keras.metrics")
        for key, value in zip(keys, averaged, strict=True):
            logs[key] = float(value)


def _is_number(value: Any) -> bool:
    try:
        return np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.number)
    except TypeError:
        return False


class RingWarmup(keras.callbacks.Callback):
    """Gradual learning-rate warmup for the linear scaling rule (Goyal et al., 2017).

    With N ranks the effective batch is N times larger, so the LR should be N times larger
    too (`scale_lr`); starting there is unstable, so over the first `warmup_epochs` the LR
    climbs linearly, per batch, from ``initial_lr / N`` to ``initial_lr``, then is left alone
    (a schedule after the warmup takes over from its first epoch on).

    The curve is Horovod's: at batch ``b`` (from 0) of epoch ``e`` the LR is
    ``initial_lr / N * (1 + (e + (b + 1) / steps_per_epoch) * (N - 1) / warmup_epochs)``,
    reaching ``initial_lr`` on the last batch of the warmup (capped there when
    `warmup_epochs` is fractional).

    Resuming with ``fit(initial_epoch=...)`` from a model saved during the warmup: the
    target is worked out from the saved LR and the optimizer's step count, so the warmup
    goes on towards the original `initial_lr`. Every rank uses rank 0's target, whatever
    the order of the callbacks (before or after `RingBroadcast`).

    Args:
        warmup_epochs: epochs the warmup lasts. Defaults to 5.
        initial_lr: the LR at the end of the warmup. Defaults to the optimizer's LR at the
            start of training (already scaled, e.g. by `scale_lr`), or, when resuming
            mid-warmup, the LR that the saved one was warming up to.
        momentum_correction: when the LR changes, rescale SGD's momentum slots by new/old,
            so that momentum carries the new LR (the paper's correction). Defaults to True.
        steps_per_epoch: batches per epoch. Defaults to what ``fit`` knows.
        verbose: 1 prints the end of the warmup on rank 0. Defaults to 0.

    An LR given as a ``LearningRateSchedule`` cannot be set per batch; use `WarmupSchedule`
    around it instead.

    Example:
        >>> model.fit(x, y, epochs=10, callbacks=[  # doctest: +SKIP
        ...     ringplug.keras.RingBroadcast(0), ringplug.keras.RingWarmup(warmup_epochs=3)])
    """

    def __init__(
        self,
        warmup_epochs: float = 5,
        initial_lr: float | None = None,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be positive, got {warmup_epochs}.")
        self.warmup_epochs = warmup_epochs
        self.initial_lr = initial_lr
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0
        self._target: float | None = None

    def fraction(self, epochs: float) -> float:
        """LR / target after `epochs` (fractional) epochs of warmup: from 1/N up to 1."""
        size = core.size()
        return (1 + min(epochs / self.warmup_epochs, 1.0) * (size - 1)) / size

    def on_train_begin(self, logs: dict | None = None) -> None:
        core.init()
        optimizer = _inner(self.model.optimizer)
        if isinstance(optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(
                "RingWarmup sets the learning rate per batch, but this optimizer's is a "
                "LearningRateSchedule, which cannot be assigned. Wrap the schedule instead: "
                "learning_rate=ringplug.keras.WarmupSchedule(schedule, warmup_steps=...)."
            )
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                "RingWarmup needs the number of batches per epoch: pass "
                "steps_per_epoch= (fit does not know it for this data)."
            )
        self._steps = steps
        target = self.initial_lr if self.initial_lr is not None else self._resumed_target(optimizer)
        if core.size() > 1:
            # Rank 0's target on every rank: the others may not hold the saved state yet.
            target = core.broadcast_object(float(target), 0, name="keras.warmup.target")
        self._target = float(target)

    def _resumed_target(self, optimizer: Any) -> float:
        """The target the optimizer's LR was warming up to, from the batches it has run."""
        lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        accumulation = getattr(optimizer, "gradient_accumulation_steps", None) or 1
        batches = int(keras.ops.convert_to_numpy(optimizer.iterations)) * accumulation
        epochs = batches / self._steps
        if 0 < epochs < self.warmup_epochs:
            return lr / self.fraction(epochs)  # saved by this warmup, part way up
        return lr

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch  # absolute: fit(initial_epoch=...) is respected

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._epoch >= self.warmup_epochs:
            return  # after the warmup the LR is left to the user (or a schedule)
        self._set(self._target * self.fraction(self._epoch + (batch + 1) / self._steps))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        last = epoch + 1 >= self.warmup_epochs > epoch
        if last and self.verbose and core.rank() == 0:
            print(
                f"\nEpoch {epoch + 1}: finished the gradual learning rate warmup to "
                f"{self._target:g}."
            )

    def _set(self, lr: float) -> None:
        set_learning_rate(self.model.optimizer, lr, self.momentum_correction)


def set_learning_rate(optimizer: Any, lr: float, momentum_correction: bool = True) -> None:
    """Assign `lr` to `optimizer` (the inner one of a loss-scale optimizer); with
    `momentum_correction`, rescale SGD's momentum slots by new/old LR, so that the velocity
    they carry matches the new rate (Keras bakes ``momentum`` into the trace, so the slots
    are what can change)."""
    optimizer = _inner(optimizer)
    old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    if lr == old:
        return
    momentums = getattr(optimizer, "momentums", None)
    if momentum_correction and momentums and old > 0:
        for slot in momentums:
            slot.assign(slot * (lr / old))
    optimizer.learning_rate = lr


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "inner_optimizer", optimizer)


@keras.saving.register_keras_serializable(package="ringplug")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule with the gradual warmup of `RingWarmup` in front.

    For step < warmup_steps the LR is ``after(step) * (1/N + (1 - 1/N) * step /
    warmup_steps)``, then ``after(step)``: from 1/N of the target up to it. Serializable, so
    saved models keep it.

    Args:
        after: the LR (a float) or schedule to warm up to.
        warmup_steps: optimizer steps the warmup lasts.
        size: N, the number of ranks. Defaults to ``ringplug.size()`` when built.
    """

    def __init__(
        self,
        after: float | keras.optimizers.schedules.LearningRateSchedule,
        warmup_steps: int,
        size: int | None = None,
    ) -> None:
        self.after = after
        self.warmup_steps = int(warmup_steps)
        self.size = int(size) if size is not None else core.size()

    def __call__(self, step: Any) -> Any:
        ops = keras.ops
        step = ops.cast(step, "float32")
        target = self.after(step) if callable(self.after) else ops.cast(self.after, "float32")
        fraction = ops.minimum(step / max(self.warmup_steps, 1), 1.0)
        return target * (1.0 / self.size + (1.0 - 1.0 / self.size) * fraction)

    def get_config(self) -> dict[str, Any]:
        after = self.after
        if isinstance(after, keras.optimizers.schedules.LearningRateSchedule):
            after = keras.saving.serialize_keras_object(after)
        return {"after": after, "warmup_steps": self.warmup_steps, "size": self.size}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> WarmupSchedule:
        after = config["after"]
        if isinstance(after, dict):
            after = keras.saving.deserialize_keras_object(after)
        return cls(after, config["warmup_steps"], config["size"])
