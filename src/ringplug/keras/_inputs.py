"""Which epoch each pass over a ringplug input is for, and the inputs that resume mid-epoch.

Keras gives a dataset no epoch: a tf.data pipeline is iterated once per epoch, and Keras may
start the next epoch's iterator at the end of the current one. So every pass over a
`BucketedInput` asks here for its epoch: the epoch of the fit that `RingBroadcast` and
`ringplug.keras.BackupAndRestore` announce (``on_epoch_begin``), or the one after its last
pass when the fit has announced none since (an iterator made ahead of its epoch; iteration
outside a fit counts passes from 0, as before).

A restored backup leaves the sampler state of its epoch here (`resume`); the first pass for
that epoch over an input of the same dataset takes it and plans only the samples that epoch
has not trained. The callback then ends that epoch after the pass's real batches
(`END_OF_RESUMED_EPOCH`), before the filler batches that keep the tf.data length Keras
measured at the start of the fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..data.plan import plan_batches, trained_samples
from ..data.progress import EpochProgress

# The plan is DistributedBucketSampler's, so its states are interchangeable with the sampler's.
SAMPLER = "DistributedBucketSampler"


class _EndOfResumedEpoch:
    """``model.stop_training`` while the resumed epoch ends early: true, so Keras's batch loop
    stops, and told apart from a ``True`` that another callback sets (EarlyStopping...),
    which the fit then keeps."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "END_OF_RESUMED_EPOCH"


END_OF_RESUMED_EPOCH = _EndOfResumedEpoch()


@dataclasses.dataclass
class Pass:
    """One pass over a `BucketedInput`: the epoch it is for and this rank's batches."""

    epoch: int
    generation: int  # of the fit it started in (0: outside any fit)
    batches: list[list[int]]  # the real batches, in order
    resumed: EpochProgress | None  # what the epoch had trained before its resume
    sequence: int  # passes over all inputs, in the order they started

    @property
    def before(self) -> int:
        """Batches each rank trained of this epoch before its resume (0 if not resumed)."""
        return self.resumed.batches if self.resumed is not None else 0

    @property
    def length(self) -> int:
        """The epoch's batches per rank, those before the resume included."""
        return self.before + len(self.batches)


@dataclasses.dataclass
class _Pending:
    epoch: int
    state: Mapping[str, Any]


class _Fit:
    """The fit that is running in this process, as ringplug's callbacks announce it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation = 0
        self.token: Any = None  # the fit's callback params (one dict per fit, shared)
        self.epoch: int | None = None  # announced by on_epoch_begin; None outside a fit
        self.pending: _Pending | None = None
        self.resumed: Pass | None = None  # the pass that took the pending state
        self.inputs: weakref.WeakSet[BucketedInput] = weakref.WeakSet()
        self.sequence = itertools.count()


FIT = _Fit()


def fit_began(token: Any) -> None:
    """A fit starts (`token`: its callbacks' shared ``params``; the second caller of one fit
    changes nothing). Its passes count epochs from the fit's own."""
    with FIT.lock:
        if token is not None and token is FIT.token:
            return
        FIT.token = token
        FIT.generation += 1
        FIT.epoch = None
        FIT.pending = None
        FIT.resumed = None


def epoch_began(epoch: int) -> None:
    """The fit starts `epoch`."""
    with FIT.lock:
        FIT.epoch = epoch


def fit_ended() -> None:
    with FIT.lock:
        FIT.token = None
        FIT.epoch = None
        FIT.pending = None


def resume(epoch: int, state: Mapping[str, Any]) -> None:
    """The next pass for `epoch` over an input of the dataset `state` is of resumes it."""
    with FIT.lock:
        FIT.pending = _Pending(epoch, state)
        FIT.resumed = None


def take_pending(epoch: int) -> Mapping[str, Any] | None:
    """The state left for `epoch` that no input took, if any (it is dropped)."""
    with FIT.lock:
        pending = FIT.pending
        if pending is None or pending.epoch != epoch:
            return None
        FIT.pending = None
        return pending.state


def resumed_pass(epoch: int) -> Pass | None:
    """The pass of this fit that resumed `epoch`, if one did."""
    with FIT.lock:
        found = FIT.resumed
        if found is None or found.epoch != epoch or found.generation != FIT.generation:
            return None
        return found


def training_input(epoch: int) -> tuple[BucketedInput, Pass] | None:
    """The input this fit trains `epoch` from: during its training batches, the one whose
    latest pass is for `epoch` (a validation input's latest pass is still of the epoch
    before); the first started if there are several."""
    with FIT.lock:
        generation = FIT.generation
        found = [
            (source.current.sequence, id(source), source, source.current)
            for source in list(FIT.inputs)
            if source.current is not None
            and source.current.generation == generation
            and source.current.epoch == epoch
        ]
    if not found:
        return None
    _, _, source, current = min(found, key=lambda item: item[:2])
    return source, current


class BucketedInput:
    """The batches of `ringplug.keras.bucketed_dataset`, pass by pass; resumable mid-epoch.

    Args:
        lengths: each sample's length.
        rules: ``batch_size``, ``max_tokens``, ``shuffle``, ``seed``, ``drop_last`` of
            `ringplug.data.plan_batches`.
        replicas, rank: the ranks, and this one.
    """

    def __init__(
        self, lengths: Sequence[int] | np.ndarray, rules: dict[str, Any], replicas: int, rank: int
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.rules = dict(rules)
        self.replicas, self.rank = replicas, rank
        self.current: Pass | None = None
        self._last_epoch: tuple[int, int] | None = None  # (generation, epoch) of the last pass
        self.full_batches = len(self._plan(0, None, self.rules["seed"]))
        with FIT.lock:
            FIT.inputs.add(self)

    def start_pass(self) -> Pass:
        """The next pass: its epoch (see the module docstring), and the rest of that epoch
        if a restored backup left it to resume."""
        with FIT.lock:
            epoch = self._next_epoch()
            progress = None
            pending = FIT.pending
            if pending is not None and pending.epoch == epoch and FIT.epoch is not None:
                try:
                    progress = EpochProgress.from_state(pending.state, SAMPLER, len(self.lengths))
                except ValueError:
                    progress = None  # another dataset's (a validation input's, say)
            if progress is not None and progress.epoch != epoch:
                progress = None
            seed = progress.seed if progress is not None else self.rules["seed"]
            remaining = progress.remaining() if progress is not None else None
            batches = self._plan(epoch, remaining, seed)
            current = Pass(epoch, FIT.generation, batches, progress, next(FIT.sequence))
            if progress is not None:
                FIT.pending = None
                FIT.resumed = current
            self._last_epoch = (FIT.generation, epoch)
            self.current = current
            return current

    def _next_epoch(self) -> int:
        announced, generation, last = FIT.epoch, FIT.generation, self._last_epoch
        if announced is None:  # outside a fit: count passes
            return 0 if last is None else last[1] + 1
        if last is None or last[0] != generation or announced > last[1]:
            return announced
        return last[1] + 1  # made ahead of its epoch, before the fit announced it

    def fillers(self, current: Pass) -> list[list[int]]:
        """Batches after a resumed pass's real ones, so that it has the declared length
        (the callback ends the epoch before them; they are never trained)."""
        if current.resumed is None or not self.rules.get("batch_size"):
            return []
        source = current.batches or self._plan(current.epoch, None, self.rules["seed"])
        return [source[k % len(source)] for k in range(self.full_batches - len(current.batches))]

    def state_dict(self, current: Pass, batches_done: int) -> dict[str, Any]:
        """The sampler state of `current`'s epoch once every rank has trained
        `batches_done` of its batches (those before a resume included)."""
        progress = current.resumed or EpochProgress.fresh(
            current.epoch, self.rules["seed"], len(self.lengths)
        )
        trained = batches_done - progress.batches
        if not 0 <= trained <= len(current.batches):
            raise ValueError(
                f"batches_done={batches_done}, but epoch {current.epoch} has "
                f"{current.length} batches per rank, {progress.batches} of them trained "
                "before its resume."
            )
        samples = trained_samples(
            self.lengths,
            trained,
            num_replicas=self.replicas,
            indices=progress.remaining() if current.resumed is not None else None,
            **self._rules(current.epoch, progress.seed),
        )
        return progress.with_trained(samples, trained).to_state(SAMPLER, self.replicas)

    def _rules(self, epoch: int, seed: int) -> dict[str, Any]:
        return {**self.rules, "seed": seed, "epoch": epoch}

    def _plan(self, epoch: int, indices: np.ndarray | None, seed: int) -> list[list[int]]:
        return plan_batches(
            self.lengths,
            num_replicas=self.replicas,
            rank=self.rank,
            indices=indices,
            **self._rules(epoch, seed),
        ).batches
