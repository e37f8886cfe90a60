"""`BackupAndRestore` for ringplug: Keras's callback, written by rank 0, restored on every
rank, mid-epoch, and saved when SIGTERM stops the job.

Keras's own ``keras.callbacks.BackupAndRestore`` under several ranks would have every rank
write the same files, restore only on hosts that have them, and, with ``save_freq`` in
steps, restart the interrupted epoch from its first batch (it records the batch but
only restores the epoch). `RingBroadcast` turns a Keras one in the same ``callbacks`` into
this one (the object's class changes, its settings stay), so ``fit(callbacks=[
ringplug.keras.RingBroadcast(0), keras.callbacks.BackupAndRestore(dir, save_freq=100)])``
works as it reads.

The files are Keras's (``latest.weights.h5``, with the optimizer's variables, and
``training_metadata.json``; a plain Keras fit can restore the epoch from them). Each is
written to a temporary name and renamed; the previous pair is kept as ``*.bkp`` until the
new one is complete, and the optimizer's step count in the metadata tells a torn pair, so a
rank killed while saving leaves a backup that restores.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import warnings
from typing import Any

import keras
import numpy as np

from .. import core
from . import _inputs, patches
from ._reduce import broadcast_variables
from .sharding import consolidate, distribute_loaded, shared_variables

logger = logging.getLogger(__name__)

VERSION = 1  # of the "ringplug" part of the metadata


class Preempted(SystemExit):
    """Raised on every rank once SIGTERM stopped training and the backup was saved.

    A ``SystemExit`` (code 0), as Lightning ends its ranks on SIGTERM: the script stops
    there, without the code after ``fit`` that would take training for finished. ``ringrun``
    itself exits with 128 + 15, so the scheduler sees a job that was stopped.
    """


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras's ``BackupAndRestore`` for several ranks: resume a stopped fit where it stopped,
    mid-epoch included, on as many ranks or another number.

    A drop-in for ``keras.callbacks.BackupAndRestore`` (the same arguments and files);
    `RingBroadcast` turns a Keras one into this one. Put it in every rank's callbacks:

    - Rank 0 writes the backup (every `save_freq` batches, or each epoch), each file to a
      temporary name and then renamed, so a rank killed while saving leaves the last
      complete backup. The other ranks write nothing.
    - At the start of ``fit``, rank 0 reads the backup and every rank gets its weights,
      optimizer state and epoch, so the backup needs only be where rank 0 runs.
    - Mid-epoch: with `ringplug.keras.bucketed_dataset` as the training data, the backup holds
      which samples the epoch had trained; the restored fit deals only the others to the
      ranks there are now, each once, and ends the epoch after them (only the batches after
      the last backup are trained twice). Other data (arrays, ``tf.data`` shards of each
      rank) cannot resume mid-epoch: the epoch is trained again from its start, with a
      warning that says so.
    - SIGTERM (``ringrun`` passes the scheduler's on, and kills 25 s later): every rank
      stops after the same batch, rank 0 writes the backup of that batch, and every rank
      raises `Preempted`. The ranks agree on it with one small collective per batch,
      started before the batch and waited for after it.

    A backup that cannot be restored is an error on every rank that says why (written by
    another model, damaged files) and what to do.

    Args:
        backup_dir: the folder of the backup, on rank 0's host; only this callback's files.
        save_freq: ``"epoch"`` (default) or a number of batches between backups.
        double_checkpoint: also keep the previous backup (``*.bkp``), restored when the latest
            cannot be read. Defaults to False.
        delete_checkpoint: delete the backup when ``fit`` ends (not when SIGTERM stops it).
            Defaults to True.
        save_on_sigterm: on SIGTERM, stop every rank after the same batch and save.
            Defaults to True.

    Example:
        >>> model.fit(data, epochs=10, callbacks=[  # doctest: +SKIP
        ...     ringplug.keras.RingBroadcast(0),
        ...     ringplug.keras.BackupAndRestore("/shared/run1/backup", save_freq=200)])
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        save_on_sigterm: bool = True,
    ) -> None:
        super().__init__(backup_dir, save_freq, double_checkpoint, delete_checkpoint)
        self.save_on_sigterm = save_on_sigterm
        _init_ringplug_state(self)

    # ------------------------------------------------------------------ restore
    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._ringplug_restored_for is not self.params:
            self.restore()
        self._install_sigterm()

    def restore(self) -> bool:
        """Restore the backup, if there is one, on every rank (every rank calls it): rank 0
        reads it, every rank gets its weights, optimizer state, epoch and place in the epoch.
        Called at the start of ``fit``. Returns whether a backup was restored.

        Raises:
            ValueError: on every rank, when the backup is of another model or cannot be
                read; the message says what to do.
        """
        core.init()
        self._ringplug_restored_for = self.params
        _inputs.fit_began(self.params)
        model = self.model
        if not model.built:
            super()._load_model()  # Keras's error for a model that is not built
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        outcome = self._read() if core.rank() == 0 else None
        if core.size() > 1:
            outcome = core.broadcast_object(outcome, 0, name="keras.backup.restore")
        kind, payload = outcome
        if kind == "error":
            raise ValueError(payload)
        if kind == "none":
            return False
        broadcast_variables(_state_variables(model), 0, name="keras.backup")
        # A zero=1 optimizer: rank 0 loaded the whole state; each rank takes its shard.
        distribute_loaded(optimizer, 0)
        self._apply(payload)
        return True

    def _read(self) -> tuple[str, Any]:
        """Rank 0: load the newest complete backup into the model: ("none", None),
        ("ok", metadata) or ("error", message)."""
        weights, metadata = self._weights_path, self._training_metadata_path
        previous_weights = self._prev_weights_path
        previous_metadata = self._prev_training_metadata_path
        files = [weights, metadata, previous_weights, previous_metadata]
        if not any(os.path.exists(path) for path in files):
            return "none", None
        pairs = [(metadata, weights), (metadata, previous_weights),
                 (previous_metadata, previous_weights), (previous_metadata, weights)]  # fmt: skip
        reasons: list[str] = []
        for metadata_path, weights_path in pairs:
            if not os.path.exists(weights_path) or not os.path.exists(metadata_path):
                continue
            try:
                found = self._load_pair(metadata_path, weights_path)
            except _OtherModel as error:
                return "error", str(error)
            except _Unreadable as error:
                reasons.append(str(error))
                continue
            if metadata_path != metadata or weights_path != weights:
                logger.warning(
                    "ringplug: the latest backup in %s could not be restored (%s); restored "
                    "the previous one (%s).",
                    self.backup_dir,
                    "; ".join(reasons) or "incomplete",
                    os.path.basename(weights_path),
                )
            return "ok", found
        if not reasons and os.path.exists(weights) and not os.path.exists(metadata):
            try:  # Keras's own layout allows weights alone: epoch 0
                self.model.load_weights(weights)
            except (OSError, ValueError) as error:
                reasons.append(f"{os.path.basename(weights)} cannot be loaded: {error}")
            else:
                return "ok", {"epoch": 0}
        listing = ", ".join(sorted(os.listdir(self.backup_dir)))
        return "error", (
            f"ringplug.keras.BackupAndRestore: the backup in {self.backup_dir} cannot be "
            f"restored: {'; '.join(reasons) or 'no complete pair of weights and metadata'} "
            f"(the folder holds: {listing}). If the files were damaged, delete the folder to "
            "start training afresh (or copy back a good backup); give backup_dir a folder "
            "that only this callback writes to."
        )

    def _load_pair(self, metadata_path: str, weights_path: str) -> dict[str, Any]:
        name = os.path.basename(metadata_path)
        try:
            with open(metadata_path) as file:
                metadata = json.load(file)
        except (OSError, ValueError) as error:
            raise _Unreadable(f"{name} is not JSON ({error})") from None
        if not isinstance(metadata, dict) or not isinstance(metadata.get("epoch"), int):
            raise _Unreadable(f"{name} has no epoch number (it holds {str(metadata)[:80]})")
        ours = metadata.get("ringplug")
        if ours is not None:
            if not isinstance(ours, dict) or ours.get("version") != VERSION:
                raise _Unreadable(
                    f"{name} is of another ringplug (its 'ringplug' part has version "
                    f"{ours.get('version') if isinstance(ours, dict) else ours!r}, this one "
                    f"reads {VERSION})"
                )
            _check_same_model(self.model, ours.get("variables"), self.backup_dir)
        try:
            self._load_weights(weights_path)
        except (OSError, ValueError) as error:
            raise _Unreadable(
                f"{os.path.basename(weights_path)} cannot be loaded ({str(error)[:300]})"
            ) from None
        if ours is not None:
            steps = _iterations(self.model.optimizer)
            if steps != ours.get("steps"):
                raise _Unreadable(
                    f"{os.path.basename(weights_path)} is of step {steps}, {name} of step "
                    f"{ours.get('steps')} (a save that did not finish)"
                )
        return metadata

    def _load_weights(self, path: str) -> None:
        if path.endswith(".weights.h5"):
            self.model.load_weights(path)
            return
        # Keras loads only files named *.weights.h5: the previous one (*.bkp) under such a name.
        alias = os.path.join(self.backup_dir, ".restoring.weights.h5")
        with contextlib.suppress(FileNotFoundError):
            os.remove(alias)
        try:
            os.link(path, alias)
        except OSError:
            shutil.copyfile(path, alias)
        try:
            self.model.load_weights(alias)
        finally:
            os.remove(alias)

    def _apply(self, metadata: dict[str, Any]) -> None:
        """Every rank: continue from the restored backup's epoch and place in it."""
        epoch = int(metadata["epoch"])
        ours = metadata.get("ringplug") or {}
        done = int(ours.get("batches_done", 0))
        data = ours.get("data")
        self.model._initial_epoch = epoch
        self._current_epoch = epoch
        written_by = ours.get("world_size")
        where = f"epoch {epoch}" + (f", after {done} of its batches" if done else "")
        if core.rank() == 0:
            logger.warning(
                "ringplug: restored the backup in %s: %s, step %s%s.",
                self.backup_dir,
                where,
                ours.get("steps", "?"),
                f" (written by {written_by} ranks, {core.size()} now)"
                if written_by not in (None, core.size())
                else "",
            )
        if not done:
            return
        if data is not None and getattr(self.model, "steps_per_execution", 1) == 1:
            _inputs.resume(epoch, data)
            self._ringplug_resuming = epoch
            return
        reason = "steps_per_execution" if data is not None else "data"
        self._warn_not_resumable(epoch, done, written_by, reason)

    def _warn_not_resumable(
        self, epoch: int, done: int, written_by: Any, reason: str | None
    ) -> None:
        if core.rank() != 0:
            return
        if reason == "data":
            why = (
                "the training data is not one ringplug can resume mid-epoch (arrays, or "
                "tf.data that each rank shards and shuffles itself)"
            )
        elif reason == "steps_per_execution":
            why = "the model runs several steps per execution (steps_per_execution > 1)"
        else:
            why = (
                "this fit's training data is not the ringplug.keras.bucketed_dataset the "
                "backup was written with"
            )
        if written_by not in (None, core.size()):
            why += (
                f", and the backup was written by {written_by} ranks, {core.size()} now, so "
                "each rank's share of the data is another"
            )
        message = (
            f"ringplug: the backup is of epoch {epoch} after {done} of its batches, but {why}: "
            f"epoch {epoch} is trained again from its start, so the samples of its first "
            f"{done} batches are trained twice. For an exact resume, give fit a "
            "ringplug.keras.bucketed_dataset(...) (the same on every rank; it deals the "
            "samples itself) with steps_per_execution=1."
        )
        warnings.warn(message, stacklevel=3)
        logger.warning(message)

    # ------------------------------------------------------------------ training
    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        _inputs.epoch_began(epoch)
        self._ringplug_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._ringplug_sigterm is not None and core.size() > 1:
            flag = np.array([int(self._ringplug_sigterm.is_set())], np.int64)
            self._ringplug_agreement = core.allreduce_async(
                flag, "max", name="keras.backup.sigterm"
            )

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        epoch = self._ringplug_epoch
        done = self._batches_done(epoch, batch)
        stop = self._sigterm_agreed()
        if self._should_save_on_batch(batch) and not stop:
            self._save(epoch, done)
        if stop:
            self._stop(epoch, done)
        resumed = _inputs.resumed_pass(epoch)
        if resumed is not None and done >= resumed.length:
            # The resumed epoch's samples are trained: end it before the filler batches.
            self.model.stop_training = _inputs.END_OF_RESUMED_EPOCH

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.model.stop_training is _inputs.END_OF_RESUMED_EPOCH:
            self.model.stop_training = False  # the fit goes on with the next epoch
        self._current_epoch = epoch + 1
        self._last_batch_seen = 0
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._uninstall_sigterm()
        _inputs.fit_ended()
        if core.rank() == 0:
            super().on_train_end(logs)

    def _batches_done(self, epoch: int, batch: int) -> int:
        """The epoch's batches every rank has trained, those before a resume included."""
        if self._ringplug_resuming == epoch:
            self._ringplug_resuming = None
            if _inputs.resumed_pass(epoch) is None:  # no input took the backup's place
                state = _inputs.take_pending(epoch) or {}
                self._warn_not_resumable(epoch, int(state.get("batches", 0)), None, "input")
        resumed = _inputs.resumed_pass(epoch)
        return (resumed.before if resumed is not None else 0) + batch + 1

    # ------------------------------------------------------------------ saving
    def _save_model(self) -> None:  # Keras's name, for code that calls it
        self._save(self._current_epoch, 0)

    def _save(self, epoch: int, done: int) -> None:
        """Rank 0: write the backup of `epoch` after `done` of its batches (every rank calls
        it: a zero=1 optimizer's state is first collected on rank 0)."""
        if core.size() > 1:
            consolidate(self.model.optimizer, to=0)
        if core.rank() != 0:
            return
        data = None
        if done:
            found = _inputs.training_input(epoch)
            length = found[1].length if found else (self.params or {}).get("steps")
            if length and done >= length:
                epoch, done = epoch + 1, 0  # the epoch is complete: the backup is of the next
            elif found is not None:
                source, current = found
                data = source.state_dict(current, done)
        metadata = {
            "epoch": epoch,
            "batch": max(done - 1, 0),
            "ringplug": {
                "version": VERSION,
                "batches_done": done,
                "steps": _iterations(self.model.optimizer),
                "world_size": core.size(),
                "data": data,
                "variables": _fingerprint(self.model),
            },
        }
        os.makedirs(self.backup_dir, exist_ok=True)
        weights, text = self._weights_path, self._training_metadata_path
        # Keras wants the .weights.h5 ending; the leading dot keeps it apart from the backup.
        fresh_weights = os.path.join(self.backup_dir, ".writing.weights.h5")
        fresh_text = os.path.join(self.backup_dir, ".writing.json")
        self.model.save_weights(fresh_weights, overwrite=True)
        with open(fresh_text, "w") as file:
            json.dump(metadata, file)
            file.flush()
            os.fsync(file.fileno())
        # Each rename is atomic; between them the previous pair (.bkp) is complete.
        for current, previous in ((weights, self._prev_weights_path),
                                  (text, self._prev_training_metadata_path)):  # fmt: skip
            if os.path.exists(current):
                os.replace(current, previous)
        os.replace(fresh_weights, weights)
        os.replace(fresh_text, text)
        if not self.double_checkpoint:
            for previous in (self._prev_weights_path, self._prev_training_metadata_path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(previous)

    # ------------------------------------------------------------------ SIGTERM
    def _install_sigterm(self) -> None:
        if not self.save_on_sigterm or self._ringplug_sigterm is not None:
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        received = threading.Event()
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            received.set()
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._ringplug_sigterm = received
        self._ringplug_previous_handler = previous

    def _uninstall_sigterm(self) -> None:
        if self._ringplug_sigterm is None:
            return
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGTERM, self._ringplug_previous_handler)
        self._ringplug_sigterm = None
        self._ringplug_agreement = None

    def _sigterm_agreed(self) -> bool:
        """Whether any rank got SIGTERM before this batch (every rank learns it here)."""
        if self._ringplug_sigterm is None:
            return False
        if core.size() == 1:
            return self._ringplug_sigterm.is_set()
        handle, self._ringplug_agreement = self._ringplug_agreement, None
        return handle is not None and bool(np.asarray(handle.wait()).reshape(-1)[0])

    def _stop(self, epoch: int, done: int) -> None:
        step = _iterations(self.model.optimizer)
        self._save(epoch, done)
        if core.size() > 1:
            core.barrier(name="keras.backup.sigterm-saved")  # the backup is complete
        self._uninstall_sigterm()
        _inputs.fit_ended()
        message = (
            f"ringplug: SIGTERM stopped training at step {step} (epoch {epoch}, batch {done}); "
            f"saved the backup in {self.backup_dir}. Run the same fit again to resume there."
        )
        if core.rank() == 0:
            logger.warning(message)
            print(message, file=sys.stderr, flush=True)
        raise Preempted()


def _init_ringplug_state(callback: BackupAndRestore) -> None:
    callback.save_on_sigterm = getattr(callback, "save_on_sigterm", True)
    callback._ringplug_restored_for = None  # the params of the fit it restored for
    callback._ringplug_epoch = 0
    callback._ringplug_resuming = None  # the epoch a restored backup resumes mid-way
    callback._ringplug_sigterm = None
    callback._ringplug_previous_handler = None
    callback._ringplug_agreement = None


def adopt_keras_backups(callback: keras.callbacks.Callback) -> list[BackupAndRestore]:
    """The `BackupAndRestore` callbacks of the fit that `callback` is in, Keras's own made
    ringplug's (in place: same settings, files and position in the list).

    Keras shows a callback no other callback, so they are found on the ``CallbackList``
    that is calling ``on_train_begin``: a few frames up. Called from that hook only.
    """
    owner = patches.calling_callback_list(patches.caller(1))
    if owner is None:
        return []
    found = []
    for sibling in owner.callbacks:
        if type(sibling) is keras.callbacks.BackupAndRestore and patches.adopt(
            sibling, BackupAndRestore
        ):
            _init_ringplug_state(sibling)
            logger.info("ringplug: keras.callbacks.BackupAndRestore runs as ringplug's")
        if isinstance(sibling, BackupAndRestore):
            found.append(sibling)
    return found


def _state_variables(model: Any) -> list[Any]:
    return list(model.weights) + shared_variables(model.optimizer)


def _iterations(optimizer: Any) -> int | None:
    if optimizer is None or not getattr(optimizer, "built", False):
        return None
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


def _fingerprint(model: Any) -> list[list[Any]]:
    """Each weight's path and shape, in order: a backup loads by order (Keras names layers
    ``dense``, ``dense_1``, ... as they are made), so the shapes must match one by one."""
    return [[weight.path, list(weight.shape)] for weight in model.weights]


def _check_same_model(model: Any, saved: Any, folder: str) -> None:
    if not isinstance(saved, list):
        return
    here = _fingerprint(model)
    if [shape for _, shape in saved] == [shape for _, shape in here]:
        return
    differences = [
        f"weight {index} ('{theirs[0]}' there, '{ours[0]}' here) has shape "
        f"{tuple(theirs[1])} in the backup, {tuple(ours[1])} here"
        for index, (theirs, ours) in enumerate(zip(saved, here, strict=False))
        if theirs[1] != ours[1]
    ]
    if len(saved) != len(here):
        differences.append(f"the backup has {len(saved)} weights, this model {len(here)}")
    raise _OtherModel(
        f"ringplug.keras.BackupAndRestore: the backup in {folder} was written by another "
        f"model: {'; '.join(differences[:6])}. Build the model the backup was written with, "
        "or give this run its own backup_dir (or delete that folder) to start training afresh."
    )


class _Unreadable(Exception):
    """A backup file that is damaged or incomplete: the other pair may do."""


class _OtherModel(Exception):
    """A backup of another model: an error, whatever the other pair holds."""
