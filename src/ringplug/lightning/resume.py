"""RingResume: a stopped fit resumes mid-epoch, each sample of the epoch trained once.

`RingStrategy` adds this callback to the Trainer itself. With ringplug's resumable samplers
(`ringplug.data.ElasticSampler`, which RingStrategy puts where Lightning would put its
``DistributedSampler``, and `ringplug.data.DistributedBucketSampler`) it:

- writes the sampler's place into every checkpoint (``checkpoint["callbacks"]["RingResume"]``):
  which samples every rank together has trained this epoch, counted from Lightning's loop
  progress, so a checkpoint written by ``ModelCheckpoint(every_n_train_steps=K)`` mid-epoch
  knows where the epoch was;
- loads it into the sampler when ``trainer.fit(..., ckpt_path=...)`` resumes, before Lightning
  measures the training dataloader: the resumed epoch deals the samples not trained yet to
  the ranks there are now (as many as before or another number), and the dataloader's length
  is the epoch's as Lightning counts it (the batches before the checkpoint plus those left),
  so ``batch_idx``, ``global_step`` and the epoch's end go on from the checkpoint;
- has Lightning measure the training dataloader again when an epoch's length changes (the
  epoch after a resumed one, or a bucketed plan of another size), and calls ``set_epoch`` on a
  ``DistributedBucketSampler`` (Lightning calls it on samplers only);
- saves ``last.ckpt`` (through the Trainer's ``ModelCheckpoint(save_last=True)``) when SIGTERM
  stops the ranks: RingStrategy's batch agreement makes every rank stop after the same batch,
  so the save (rank 0 writes, every rank reaches the barrier) cannot deadlock. The ranks then
  end as Lightning ends them on SIGTERM (``SIGTERMException``, a ``SystemExit`` with code 0);
  ``ringrun`` itself exits with 143, so Slurm and Kubernetes see a job that was stopped.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning

logger = logging.getLogger(__name__)


def resumable_sampler(loader: Any) -> Any:
    """The loader's sampler (or batch sampler) that shards by rank and resumes mid-epoch
    (`DistributedBucketSampler`, `ElasticSampler`), or None."""
    for candidate in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if (
            getattr(candidate, "shards_by_rank", False)
            and callable(getattr(candidate, "load_state_dict", None))
            and hasattr(candidate, "resumed_batches")
        ):
            return candidate
    return None


def _sized(loader: Any) -> int | None:
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


class ResumedLoader:
    """A training dataloader whose epoch was resumed: ``len()`` counts the batches trained
    before the resume too (Lightning goes on counting from them), iteration gives the rest.

    Everything else is the wrapped loader's (its sampler, dataset, workers).
    """

    def __init__(self, loader: Any, sampler: Any) -> None:
        object.__setattr__(self, "_ringplug_loader", loader)
        object.__setattr__(self, "_ringplug_sampler", sampler)

    def __len__(self) -> int:
        return self._ringplug_sampler.resumed_batches + len(self._ringplug_loader)

    def __iter__(self) -> Any:
        return iter(self._ringplug_loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ringplug_loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ringplug_loader, name, value)


def _reset_against_length(fit_loop: Any, length: int) -> None:
    """Have the epoch loop's next ``reset()`` (only) see `length` training batches."""
    epoch_loop = fit_loop.epoch_loop
    reset = epoch_loop.reset
    own = epoch_loop.__dict__.get("reset")  # someone else's wrapper, kept

    def reset_once() -> None:
        if own is None:
            del epoch_loop.reset  # the class's own method again
        else:
            epoch_loop.reset = own
        measured, fit_loop.max_batches = fit_loop.max_batches, length
        try:
            reset()
        finally:
            fit_loop.max_batches = measured

    epoch_loop.reset = reset_once


class RingResume(Callback):
    """Keeps the training sampler's place in Lightning checkpoints and saves ``last.ckpt``
    when SIGTERM stops the ranks (added by `RingStrategy`; see the module's docstring).

    Example:
        >>> trainer = Trainer(strategy="ring", callbacks=[  # doctest: +SKIP
        ...     ModelCheckpoint(save_last=True, every_n_train_steps=100)])
        >>> trainer.fit(model, loader, ckpt_path="last")  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._trainer: Any = None
        self._sampler: Any = None  # the training loader's resumable sampler, if any
        self._loader: Any = None  # the training loader handed to Lightning
        self._length: int | None = None  # its length, as Lightning measured it
        self._pending: dict[str, Any] | None = None  # a checkpoint's sampler state, to load

    # ------------------------------------------------------------------ checkpoints
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        """The training sampler's place (every rank's is the same; rank 0's is written)."""
        trainer, sampler = self._trainer, self._sampler
        if trainer is None or sampler is None or trainer.state.fn != TrainerFn.FITTING:
            return {}
        loop = trainer.fit_loop
        epochs = loop.epoch_progress.current
        # Between on_train_epoch_start and the first batch the counts are the last epoch's.
        starting = epochs.ready > epochs.started
        batches = 0 if starting else loop.epoch_loop.batch_progress.current.processed
        try:
            state = sampler.state_dict(batches)
        except ValueError as error:
            rank_zero_warn(
                f"RingStrategy: this checkpoint holds no place in the epoch ({error}); a fit "
                "resumed from it starts the epoch's samples again."
            )
            return {}
        return {"train_sampler": state, "sampler": type(sampler).__name__}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict.get("train_sampler")

    # ------------------------------------------------------------------ the training loader
    def track(self, loader: Any, epoch: int) -> Any:
        """The training dataloader as Lightning will use it: the checkpoint's sampler state
        loaded (or the sampler set to `epoch`, the one Lightning trains next), and a length
        that counts the batches trained before a resume."""
        sampler = resumable_sampler(loader)
        self._sampler = sampler
        pending, self._pending = self._pending, None
        if sampler is None:
            if pending is not None:
                rank_zero_warn(
                    "RingStrategy: the checkpoint says where its epoch stopped, but the "
                    "training dataloader has no resumable sampler (ringplug.data."
                    "ElasticSampler or DistributedBucketSampler); the epoch starts again."
                )
            self._loader, self._length = loader, _sized(loader)
            return loader
        if pending is not None:
            sampler.load_state_dict(pending)
            # Lightning warns of a mid-epoch resume whose loader has no state_dict of its own;
            # here the sampler's place came back with the checkpoint.
            warnings.filterwarnings(
                "ignore",
                message="You're resuming from a checkpoint that ended before the epoch ended",
                category=PossibleUserWarning,
            )
        else:
            sampler.set_epoch(epoch)
        if sampler.resumed_batches:
            loader = ResumedLoader(loader, sampler)
        self._loader, self._length = loader, _sized(loader)
        return loader

    def before_epoch(self, fit_loop: Any) -> None:
        """Before Lightning prepares an epoch: the sampler moves to it, and when that changes
        the loader's length (the epoch after a resumed one) Lightning makes the training
        dataloader again, so that its batch count, validation interval and epoch end fit."""
        sampler = self._sampler
        if sampler is None or fit_loop._combined_loader is None:
            return
        epoch = fit_loop.epoch_progress.current.processed
        if sampler.epoch == epoch:
            return
        sampler.set_epoch(epoch)
        if _sized(self._loader) == self._length:
            return  # as many batches as Lightning measured: its counts hold
        logger.debug("RingResume: epoch %d has another length; the loader is made again", epoch)
        if fit_loop.epoch_loop.restarting and self._length is not None:
            # A checkpoint of the resumed epoch's last batch: Lightning has moved on to this
            # epoch, and its epoch loop, when it resets, finds the restored batch count at
            # the loader's length and starts counting the epoch from 0. That count is of the
            # resumed epoch, so it must meet that epoch's length, not this one's (else the
            # loop goes on from it and trains only this epoch's batches past it).
            _reset_against_length(fit_loop, self._length)
        if fit_loop._data_fetcher is not None:
            fit_loop._data_fetcher.teardown()
            fit_loop._data_fetcher = None
        fit_loop._combined_loader = None

    # ------------------------------------------------------------------ SIGTERM
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        last = next(
            (
                callback
                for callback in trainer.checkpoint_callbacks
                if isinstance(callback, ModelCheckpoint) and callback.save_last
            ),
            None,
        )
        step = trainer.global_step
        if last is None:
            rank_zero_warn(
                f"RingStrategy: SIGTERM stopped training at step {step} and no checkpoint was "
                "written: add ModelCheckpoint(save_last=True) to the Trainer's callbacks, and "
                "fit with ckpt_path='last' to resume from it."
            )
            return
        if last._last_global_step_saved == step and last.last_model_path:
            rank_zero_info(
                f"RingStrategy: SIGTERM stopped training at step {step}; {last.last_model_path} "
                "is already of this step."
            )
            return
        # Every rank is here after the same batch (the agreement carried the flag): rank 0
        # writes, every rank meets the barrier of Trainer.save_checkpoint.
        last._save_last_checkpoint(trainer, last._monitor_candidates(trainer))
        rank_zero_info(
            f"RingStrategy: SIGTERM stopped training at step {step}; saved "
            f"{last.last_model_path}. Resume with trainer.fit(..., ckpt_path='last')."
        )


__all__ = ["RingResume", "ResumedLoader", "resumable_sampler"]
