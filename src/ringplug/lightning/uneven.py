"""Training data whose ranks end each epoch together, whatever each rank's number of batches.

When ranks have different numbers of training batches (an ``IterableDataset``, per-rank files
with ``use_distributed_sampler=False``), a rank out of data would leave its epoch while the
others still wait for its gradients, then send the next epoch's: the job hangs, or mixes
epochs. `AgreedLoader` wraps the training dataloader so that before each batch the ranks
agree, in one small collective, whether every rank has one; what happens when some rank
has none is `RingStrategy`'s ``uneven`` argument:

- ``"drop"`` (default): every rank ends the epoch there; the ranks with batches left drop
  them, and rank 0 warns once per epoch with the counts.
- ``"join"``: the epoch goes on until the last rank runs out. A rank out of data repeats its
  last batch with its loss multiplied by zero, so it contributes zero gradients and takes
  part in every collective of the step (the logging, the buffers' broadcast), and applies
  the same averaged gradients, so the weights stay identical. The average still divides by
  the number of ranks (as DDP's ``Join`` with ``divide_by_initial_world_size=True`` and
  Horovod's ``join``): a step where k of n ranks have data gets (sum of their gradients)/n.
- ``"error"``: a `RingplugError` on every rank naming the ranks and their counts.

The same collective carries each rank's SIGTERM flag, so Lightning's own per-batch broadcast
of rank 0's flag is not needed (RingStrategy replaces it with a look at this one).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from .. import core, diagnose
from ..core import activity
from ..core.errors import RingplugError

Uneven = Literal["drop", "join", "error"]
MODES = ("drop", "join", "error")

_NAME = "ringplug.lightning.next-batch"


def check_mode(mode: str) -> Uneven:
    if mode not in MODES:
        raise ValueError(
            f"RingStrategy(uneven={mode!r}): use 'drop' (the default), 'join' or 'error'."
        )
    return mode  # type: ignore[return-value]


def _sized(loader: Any) -> int | None:
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class AgreedLoader:
    """A training dataloader whose iterators stop on every rank at the same batch.

    Everything but iteration and ``len()`` is the wrapped loader's (its sampler, dataset,
    state), so Lightning and callbacks see the loader they were given. ``len()`` is the
    number of batches every rank runs: the shortest rank's for "drop" and "error", the
    longest's for "join" (undefined when some rank's loader has no length).

    Made on every rank in the same order (one collective learns every rank's length).
    """

    def __init__(
        self, loader: Any, mode: Uneven, phantoms: collections.deque[bool], sigterm: Any
    ) -> None:
        own = object.__setattr__
        own(self, "_ringplug_loader", loader)
        own(self, "_ringplug_mode", mode)
        own(self, "_ringplug_phantoms", phantoms)
        own(self, "_ringplug_sigterm", sigterm)
        own(self, "_ringplug_epoch", 0)
        own(self, "_ringplug_rounds", 0)
        own(self, "_ringplug_pending", None)
        lengths = core.allgather_object(_sized(loader), name="ringplug.lightning.batches")
        own(self, "_ringplug_lengths", lengths)
        known = None if None in lengths else lengths
        if known is not None and mode == "error" and len(set(known)) > 1:
            raise RingplugError(
                "RingStrategy(uneven='error'): the ranks have different numbers of training "
                f"batches ({', '.join(f'rank {r}: {n}' for r, n in enumerate(known))}). Give "
                "every rank the same number of batches, or pass uneven='drop' (the default) "
                "or uneven='join'."
            )
        agreed = None if known is None else (max(known) if mode == "join" else min(known))
        own(self, "_ringplug_length", agreed)

    def _ringplug_agreement(self, flags: np.ndarray) -> Any:
        """Start one agreement (at most two are in flight: their names alternate)."""
        rounds = self._ringplug_rounds
        object.__setattr__(self, "_ringplug_rounds", rounds + 1)
        handle = core.allgather_async(flags, name=f"{_NAME}.{rounds % 2}")
        object.__setattr__(self, "_ringplug_pending", handle)
        return handle

    def __len__(self) -> int:
        if self._ringplug_length is None:
            raise TypeError("a rank's training dataloader has no length")
        return self._ringplug_length

    def __iter__(self) -> Iterator[Any]:
        if self._ringplug_pending is not None:
            # The last epoch's look-ahead, which every rank started: let it finish first.
            self._ringplug_pending.wait()
        self._ringplug_phantoms.clear()
        epoch = self._ringplug_epoch
        object.__setattr__(self, "_ringplug_epoch", epoch + 1)
        lengths = self._ringplug_lengths
        if (
            core.rank() == 0
            and self._ringplug_mode == "drop"
            and None not in lengths
            and len(set(lengths)) > 1
        ):
            shortest = min(lengths)
            dropping = [r for r, n in enumerate(lengths) if n > shortest]
            _warn(
                f"RingStrategy(uneven='drop'): the ranks have {', '.join(map(str, lengths))} "
                f"training batches; in epoch {epoch} every rank runs {shortest} and "
                f"{_ranks(dropping)} {'drops' if len(dropping) == 1 else 'drop'} "
                f"{' and '.join(str(lengths[r] - shortest) for r in dropping)}, so that no "
                "rank waits for another's gradients. Give every rank the same number of "
                "batches, or pass uneven='join' to train on all of them."
            )
        return _AgreedIterator(self, iter(self._ringplug_loader), epoch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ringplug_loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ringplug_loader, name, value)


class _AgreedIterator:
    """Yields the wrapped iterator's batches while the ranks agree that each has one.

    The agreement for a batch is started when the batch is fetched, one batch ahead of
    the one Lightning asks for, so it runs in the engine while the rank trains (Lightning
    itself fetches one batch ahead): asking for a batch costs a local fetch and a
    submission, not a round trip.
    """

    def __init__(self, owner: AgreedLoader, inner: Iterator[Any], epoch: int) -> None:
        self._owner = owner
        self._inner: Iterator[Any] | None = inner
        self._epoch = epoch
        self._fetched = 0  # real batches fetched so far
        self._last: Any = None
        self._ahead: tuple[Any, bool, Any] | None = None  # fetched, announced, not yet asked for
        self._done = False
        self._sizes = owner._ringplug_lengths

    def __iter__(self) -> _AgreedIterator:
        return self

    def _announce(self) -> None:
        """Fetch the next local batch (if any) and start the ranks' agreement on it."""
        batch, has = None, False
        if self._inner is not None:
            activity.set_phase(activity.WAITING_FOR_DATA)
            start = time.perf_counter()
            try:
                batch, has = next(self._inner), True
            except StopIteration:
                self._inner = None
            clock = diagnose.active()
            if clock is not None and has:
                clock.data(start, time.perf_counter())  # this rank's own loading only
        if not has:
            activity.set_phase(activity.OUT_OF_DATA)
        owner = self._owner
        flags = np.array([has, owner._ringplug_sigterm(), self._fetched], np.int64)
        self._fetched += has
        self._ahead = (batch, has, owner._ringplug_agreement(flags))

    def __next__(self) -> Any:
        if self._ahead is None:
            if self._done:
                raise StopIteration
            self._announce()
        assert self._ahead is not None
        (batch, has, handle), self._ahead = self._ahead, None
        everyone = handle.wait().reshape(-1, 3)
        owner = self._owner
        if everyone[:, 1].any():
            owner._ringplug_sigterm.seen = True
        having = everyone[:, 0].astype(bool)
        if having.all():
            return self._take(batch, phantom=False)
        self._done = not having.any()
        if self._done:
            raise StopIteration
        out = [r for r in range(len(having)) if not having[r]]
        counts = [int(c) for c in everyone[:, 2]]
        mode = owner._ringplug_mode
        if mode == "error":
            self._done = True
            raise RingplugError(
                f"RingStrategy(uneven='error'): {_ranks(out)} ran out of training data in "
                f"epoch {self._epoch} after {', '.join(str(counts[r]) for r in out)} batches "
                f"while {_ranks([r for r in range(len(having)) if having[r]])} had more "
                f"(batches so far: {', '.join(map(str, counts))}). Give every rank the same "
                "number of batches, or pass uneven='drop' or uneven='join'."
            )
        if mode == "join":
            empty = [r for r in out if counts[r] == 0]
            if empty:
                self._done = True
                raise RingplugError(
                    f"RingStrategy(uneven='join'): {_ranks(empty)} had no training batch at "
                    "all this epoch; 'join' repeats a rank's last batch with zero weight, so "
                    "each rank needs at least one. Give every rank data, or use uneven='drop'."
                )
            if has:
                return self._take(batch, phantom=False)
            return self._take(self._last, phantom=True)
        self._warn_dropped(out, having, counts)
        self._done = True
        raise StopIteration

    def _take(self, batch: Any, phantom: bool) -> Any:
        if not phantom:
            self._last = batch
        self._owner._ringplug_phantoms.append(phantom)
        self._announce()  # the next batch's agreement runs while this one trains
        return batch

    def _warn_dropped(self, out: list[int], having: np.ndarray, counts: list[int]) -> None:
        if core.rank() != 0:
            return
        left = [r for r in range(len(having)) if having[r]]
        sizes = self._sizes
        if any(sizes[r] is None for r in left):
            dropped = "what they had left"
        else:
            dropped = " and ".join(str(sizes[r] - counts[r]) for r in left) + " batches"
        _warn(
            f"RingStrategy(uneven='drop'): {_ranks(out)} ran out of training data after "
            f"{', '.join(str(counts[r]) for r in out)} batches in epoch {self._epoch}; "
            f"{_ranks(left)} dropped {dropped}, so that every rank ends the epoch together. "
            "Give every rank the same number of batches, or pass uneven='join' to train on "
            "all of them."
        )


def _warn(text: str) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(text)


class SigtermFlag:
    """Lightning's SIGTERM flag, agreed between the ranks.

    Lightning's SIGTERM handler sets ``trainer.received_sigterm`` on the rank that got the
    signal (and broadcasts from inside the handler), and its loops stop the rank at the end
    of the batch where they see it; a rank that stops alone leaves the others in their next
    collective. Here the connector's class gets `_AgreedFlag` mixed in: the flag the handler
    sets is this rank's contribution to the next batch agreement (no broadcast in the
    handler), and every check of Lightning's reads what the agreement said: any rank's
    SIGTERM, on every rank, at the same batch.
    """

    def __init__(self, trainer: Any) -> None:
        from . import patches  # here: the Trainer's module may be importing at ours

        connector = trainer._signal_connector
        local = bool(getattr(connector, "received_sigterm", False))
        patches.agree_on_sigterm(connector, _AgreedFlag)
        connector._ringplug_local = local
        connector._ringplug_seen = False
        self._connector = connector

    def __call__(self) -> bool:
        return self._connector._ringplug_local

    @property
    def seen(self) -> bool:
        return self._connector._ringplug_seen

    @seen.setter
    def seen(self, value: bool) -> None:
        self._connector._ringplug_seen = value


class _AgreedFlag:
    """Mixed into Lightning's signal connector: `received_sigterm` as the ranks agreed it."""

    _ringplug_local = False
    _ringplug_seen = False

    @property
    def received_sigterm(self) -> bool:
        return self._ringplug_seen

    @received_sigterm.setter
    def received_sigterm(self, value: bool) -> None:
        self._ringplug_local = bool(value)
        if not value:
            self._ringplug_seen = False  # a new fit starts afresh

    def _sigterm_notifier_fn(self, signum: Any, _frame: Any) -> None:
        # Lightning's handler also broadcasts from inside the signal handler: a collective
        # that only the signalled rank makes, waiting for ranks that never join it. The
        # next batch agreement carries the flag instead.
        if not self._ringplug_local:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        self._ringplug_local = True
        if not core.is_initialized() or core.size() == 1:
            self._ringplug_seen = True  # a single rank has no agreement to wait for
