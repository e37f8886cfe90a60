"""Elastic training on ringrun's restarts: a `State` that every rank commits at the same
points, and `run`, which starts a restarted job from the newest commit.

ringplug does not re-form a job in place (the MPI wheels have no fault-tolerance extension):
a lost peer ends the job, and ``ringrun --max-restarts N`` starts it again with the ranks
left. So a commit is kept in memory and also written to disk, by one rank a host, and `run`
starts the restarted job from the newest commit any host still has:

1. restore it (a restart only: ``RINGPLUG_RESTART`` > 0),
2. call the reset callbacks when the number of ranks is not what it was at that commit,
3. sync the state from rank 0, then call the training function.

Commits live in ``$RINGPLUG_ELASTIC_DIR`` (give a shared filesystem to survive the loss of
the host of every writer) or else in ``<tempdir>/ringplug-elastic-<job id>``; ringrun gives
every start of one job the same ``RINGPLUG_JOB_ID``. Outside an elastic ringrun job (no job
id, no directory) commits stay in memory only.

`ObjectState` keeps plain values; ``ringplug.torch.elastic.TorchState``,
``ringplug.keras.elastic`` and ``ringplug.tensorflow.elastic`` keep a framework's models and
optimizers. Horovod's ``hvd.elastic`` is these under Horovod's names.

Example::

    from ringplug import elastic

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(elastic.ObjectState(epoch=0))
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import re
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import core
from .config import elastic_setting
from .core.errors import RingplugError

logger = logging.getLogger(__name__)

__all__ = [
    "CommitStore",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "check_commit_fits",
    "run",
]

_COMMIT_FILE = re.compile(r"^commit-(\d+)\.pkl$")


class HostsUpdatedInterrupt(RuntimeError):
    """The signal that hosts were added or removed, for Horovod's scripts that catch it.
    ringplug never raises it: a job does not change its ranks while it runs (ringrun
    restarts it instead)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__()
        self.skip_sync = skip_sync


class CommitStore:
    """The commits of one job on disk: ``commit-<n>.pkl`` files, each written whole to a
    temporary name first and renamed, so a rank killed while writing leaves the one before.

    Args:
        directory: where the files go; None keeps no files (`write` does nothing).
    """

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory) if directory is not None else None

    @classmethod
    def from_environment(cls) -> CommitStore:
        """The store of the elastic job this rank is in (see the module's docstring)."""
        _, job_id, directory = elastic_setting()
        if directory is not None:
            return cls(directory)
        if job_id is None:
            return cls(None)
        # ringrun removes it by the same name (ringplug.run.launch.elastic, not imported:
        # the launcher's modules are not a rank's to load).
        return cls(Path(tempfile.gettempdir()) / f"ringplug-elastic-{job_id}")

    def write(self, number: int, size: int, data: bytes) -> None:
        """Keep `data` as commit `number`, made by `size` ranks, then remove the older
        ones. (No fsync: the file survives the writer's process, not its host's crash.)"""
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"commit-{number}.pkl"
        # Unique per writer: on a shared filesystem every host's writer renames its own.
        partial = final.with_name(f".{final.name}.{socket.gethostname()}.{os.getpid()}")
        with open(partial, "wb") as out:
            out.write(size.to_bytes(8, "little"))  # two writes: no copy of a large state
            out.write(data)
        os.replace(partial, final)
        for older, path in self._commits():
            if older < number:
                path.unlink(missing_ok=True)

    def latest(self) -> int:
        """The newest commit's number here, or -1 when there is none."""
        return max((number for number, _ in self._commits()), default=-1)

    def read(self, number: int) -> tuple[int, bytes]:
        """Commit `number`: the number of ranks that made it, and its data."""
        assert self.directory is not None
        data = (self.directory / f"commit-{number}.pkl").read_bytes()
        return int.from_bytes(data[:8], "little"), data[8:]

    def _commits(self) -> list[tuple[int, Path]]:
        if self.directory is None or not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _COMMIT_FILE.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return found


class State:
    """What elastic training keeps across a lost rank: saved by `commit`, put back by
    `restore`, made the same on every rank by `sync`. Subclasses say what the state is
    (`ObjectState`, ``TorchState``, ``KerasState``).

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (default: ringplug's).
        get_rank: this rank (default: ``ringplug.rank``).
    """

    def __init__(
        self,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
    ) -> None:
        self._bcast_object = bcast_object or (lambda obj: core.broadcast_object(obj, 0))
        self._rank = get_rank or core.rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._commit_number = 0  # commits made by this job, those before a restart too
        self._saved: bytes | None = None
        self._store: CommitStore | None = None

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Call `callbacks` after a reset: when the job resumes with another number of ranks
        (e.g. to scale the learning rate by the new ``ringplug.size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: Any) -> None:
        """The notification hook of Horovod's states; ringrun sends none (hosts change at a
        restart)."""

    def commit(self) -> None:
        """Save the state, in memory and (in an elastic ringrun job) on disk, so that a
        restart after a lost rank resumes from here. Every rank calls it at the same point;
        it does not communicate. See docs/elastic.md for what a commit costs."""
        self.save()
        self._commit_number += 1
        if core.local_rank() == 0:
            assert self._saved is not None
            self._commit_store().write(self._commit_number, core.size(), self._saved)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Where Horovod raises `HostsUpdatedInterrupt` when hosts were added or removed.
        Under ringrun that never happens to a running job (a lost rank ends it, and new
        hosts join at the next restart), so this returns at once, with no communication."""

    def save(self) -> None:
        """Keep the state in memory (what `restore` puts back)."""
        self._saved = self._dumps(self._snapshot())

    def restore(self) -> None:
        """Put back the last saved state, undoing the changes made since."""
        if self._saved is not None:
            self._apply(self._loads(self._saved))

    def sync(self) -> None:
        """Give every rank rank 0's state, and save it."""
        self._apply(self._bcast_object(self._snapshot()))
        self.save()

    def reset(self) -> None:
        """Prepare for another number of ranks (before the sync); nothing by default."""

    # What a subclass says: its state as picklable values, and how to put them back.
    def _snapshot(self) -> Any:
        raise NotImplementedError

    def _apply(self, snapshot: Any) -> None:
        raise NotImplementedError

    def _dumps(self, snapshot: Any) -> bytes:
        return pickle.dumps(snapshot, protocol=5)

    def _loads(self, data: bytes) -> Any:
        return pickle.loads(data)  # noqa: S301 - this job's own commit

    def _commit_store(self) -> CommitStore:
        if self._store is None:
            self._store = CommitStore.from_environment()
        return self._store

    def _resume(self) -> bool:
        """Load the newest commit any rank's host has (a restart only); whether the number
        of ranks changed since it was made."""
        restart, _, _ = elastic_setting()
        if restart == 0:
            return False
        store = self._commit_store()
        numbers = core.allgather_object(store.latest(), name="elastic.latest")
        newest = max(numbers)
        if newest < 0:
            logger.warning(
                "elastic: restart %d found no commit in %s; training starts over.",
                restart,
                store.directory,
            )
            return False
        root = numbers.index(newest)
        data = store.read(newest) if core.rank() == root else None
        size_then, saved = core.broadcast_object(data, root)
        self._saved, self._commit_number = saved, newest
        self.restore()
        if self._rank() == 0:
            print(
                f"elastic: restart {restart}: resumed from commit {newest} "
                f"(made by {size_then} ranks; {core.size()} now)",
                file=sys.stderr,
                flush=True,
            )
        return size_then != core.size()


class ObjectState(State):
    """State of plain Python values, each given as a keyword argument and kept as an
    attribute of the same name (``state.epoch``). The values must pickle.

    Args:
        bcast_object: as `State` (positional, as Horovod's; optional).
        get_rank: as `State` (positional, as Horovod's; optional).
        **kwargs: the values, e.g. ``epoch=0, batch=0``.

    Example::

        state = ringplug.elastic.ObjectState(epoch=0, batch=0)
        state.epoch = 3
        state.commit()
        state.epoch = 4
        state.restore()  # state.epoch == 3 again
    """

    def __init__(
        self,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.save()

    def _snapshot(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def _apply(self, snapshot: dict[str, Any]) -> None:
        for name, value in snapshot.items():
            setattr(self, name, value)


def check_commit_fits(
    attribute: str,
    here: list[tuple[str, tuple[int, ...]]],
    saved: list[tuple[str, tuple[int, ...]]],
) -> None:
    """Refuse to put a commit's variables into others: `here` and `saved` are the (name,
    shape) of each variable of ``state.<attribute>`` now and in the commit, in order.

    Raises:
        ValueError: they differ in number or in a shape, naming the first difference.
    """
    if [shape for _, shape in here] == [shape for _, shape in saved]:
        return
    if len(here) != len(saved):
        detail = f"the commit holds {len(saved)} variables for it, and it has {len(here)}"
    else:
        index = next(i for i, (a, b) in enumerate(zip(here, saved, strict=True)) if a[1] != b[1])
        detail = (
            f"variable {index} is {saved[index][0]!r} of shape {saved[index][1]} in the commit "
            f"and {here[index][0]!r} of shape {here[index][1]} here"
        )
    raise ValueError(
        f"elastic: the commit does not fit state.{attribute} ({detail}). A restarted job "
        "must build the same model and optimizer as the job that committed: check that the "
        "script and its arguments did not change, or start the job afresh (its commits are "
        "in RINGPLUG_ELASTIC_DIR, else in <tmp>/ringplug-elastic-<RINGPLUG_JOB_ID>)."
    )


def run(
    func: Callable[..., Any], failures: tuple[type[BaseException], ...] = (RingplugError,)
) -> Callable[..., Any]:
    """Decorate the training function ``func(state, ...)``: it runs after `state` is
    resumed (see the module's docstring). A failed collective (a lost peer) ends this rank
    with the error, so that ringrun restarts the job; nothing is retried in place.

    Args:
        func: the training function; its first argument is the `State`.
        failures: the exceptions a failed collective raises in `func`, which are reported
            as ending the rank (ringplug's own; TensorFlow adds the ``tf.errors`` its ops
            raise). Others pass through as they are.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not core.is_initialized():
            core.init()
        global _resumed
        if not _resumed:
            _resumed = True
            if state._resume():
                state.on_reset()
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except failures as error:
            print(
                f"elastic: rank {core.rank()}: {type(error).__name__} in "
                f"{getattr(func, '__name__', 'the training function')}; ending this rank so "
                "that ringrun restarts the job from the last commit (--max-restarts).",
                file=sys.stderr,
                flush=True,
            )
            raise

    return wrapper


_resumed = False  # a process resumes from disk once: a second run() call only syncs
