"""`DistributedBucketSampler` and `pad_collate`: variable-length data for torch DataLoaders."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from .. import core
from . import _ranks
from .plan import Plan, plan_batches, trained_samples
from .progress import EpochProgress

logger = logging.getLogger(__name__)


class DistributedBucketSampler(BatchSampler):
    """A batch sampler that gives each rank whole samples, in batches of similar lengths,
    and the same number of batches on every rank.

    Use it as a DataLoader's ``batch_sampler`` (with `pad_collate` as ``collate_fn``)::

        sampler = DistributedBucketSampler(dataset.lengths, max_tokens=32 * 400)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate)

    Under ``ringrun`` with a plain DataLoader, or in ``Trainer(strategy="ring")`` (where
    Lightning leaves it alone, wherever the DataLoader was made), each rank reads its own
    batches. Call ``set_epoch(e)`` each epoch for a new order (RingStrategy does; Lightning
    itself calls it on samplers, not on batch samplers).

    An epoch stopped midway resumes where it stopped, with as many ranks or another number
    (elastic training): ``state_dict(batches_done)`` records which samples every rank has
    trained, and after ``load_state_dict`` the ranks of the new job share out the rest of
    the epoch, each sample once, in batches made by the same rules, the same number on every
    rank. The epoch after it is whole again::

        checkpoint["sampler"] = sampler.state_dict(batches_done)  # rank 0's is enough
        ...
        sampler.load_state_dict(checkpoint["sampler"])  # after the restart, on every rank

    Args:
        lengths: each sample's length (tokens, frames, pixels of width...).
        batch_size: samples per batch; or
        max_tokens: a budget of padded elements per batch (longest length x samples), for
            batches with as many short samples or as few long ones as fit.
        num_replicas: the number of ranks; defaults to ringplug's world (started at first
            use under a launcher) or a single process.
        rank: this rank; defaults as `num_replicas` does.
        shuffle: the order changes every epoch, the same on every rank.
        seed: the shuffle's seed, the same on every rank.
        drop_last: drop the batches that would make the ranks' counts unequal instead of
            completing the last round with repeated samples.
        sampler: set by Lightning's sampler injection (a ``DistributedSampler``); only its
            ranks are used.

    Attributes:
        repeated_samples: samples repeated this epoch to equalize the counts (logged once).
        resumed_batches: the batches each rank had trained of this epoch before it was
            resumed by `load_state_dict` (0 for an epoch that was not).
    """

    shards_by_rank = True  # RingStrategy leaves samplers that say so to themselves

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        sampler: Sampler | None = None,
    ) -> None:
        if isinstance(lengths, Sampler):
            raise TypeError(
                "DistributedBucketSampler already shards the data by rank; Lightning tried to "
                "rebuild it with its own sampler. Use Trainer(strategy='ring'), create the "
                "DataLoader inside a *_dataloader hook, or set "
                "Trainer(use_distributed_sampler=False)."
            )
        if isinstance(sampler, DistributedSampler):
            num_replicas, rank = sampler.num_replicas, sampler.rank
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.repeated_samples = 0
        self._reported = False
        self._cached: tuple[tuple[int, int, int], Plan] | None = None
        self._resumed: EpochProgress | None = None  # what was done of self.epoch at its resume
        self._yielded = 0  # batches the latest iterator has given out
        self._plan(0)  # check the arguments now, not at the first batch

    def set_epoch(self, epoch: int) -> None:
        """Plan `epoch` in full; but the epoch that `load_state_dict` resumed keeps its
        resumed plan (Lightning calls ``set_epoch`` at the start of the epoch it resumes)."""
        if epoch != self.epoch:
            self._resumed = None
            self._cached = None
            self._yielded = 0
        self.epoch = epoch

    @property
    def resumed_batches(self) -> int:
        """The batches each rank had trained of this epoch before its resume (else 0)."""
        return self._resumed.batches if self._resumed is not None else 0

    def state_dict(self, batches_done: int | None = None) -> dict[str, Any]:
        """This epoch's progress, for a checkpoint: the epoch, the seed and the samples that
        every rank together has trained, those before a resume included.

        The ranks' shares follow from the plan (the same seed, epoch and world on every
        rank), so any one rank's state stands for all of them: save rank 0's.

        Args:
            batches_done: the batches every rank has trained this epoch, counting those
                before a resume: Lightning's
                ``trainer.fit_loop.epoch_loop.batch_progress.current.completed``; in a loop
                of your own, ``enumerate(loader, start=sampler.resumed_batches)`` counts
                alike. None (the default) counts the batches this rank's iterator has given
                out; a DataLoader with workers takes batches ahead of training
                (``prefetch_factor`` per worker), which would then count as trained and be
                skipped after the resume. Pass the trained count when you can.

        Returns:
            A dict of ints and strings (the trained samples as a base64 bitmap, see
            `ringplug.data.progress`) that pickle, ``torch.save`` and JSON keep.

        Raises:
            ValueError: `batches_done` is fewer than were trained before the resume, or
                more than the epoch has.
        """
        replicas, _ = self._ranks()
        plan = self._plan(self.epoch)
        progress = self._resumed or EpochProgress.fresh(self.epoch, self.seed, len(self.lengths))
        trained = self._yielded if batches_done is None else batches_done - progress.batches
        if not 0 <= trained <= len(plan.batches):
            raise ValueError(
                f"DistributedBucketSampler.state_dict: batches_done={batches_done}, but epoch "
                f"{self.epoch} has {progress.batches + len(plan.batches)} batches per rank, "
                f"{progress.batches} of them trained before its resume. batches_done counts "
                f"the epoch's batches so far, those before the resume included: give one "
                f"from {progress.batches} to {progress.batches + len(plan.batches)}."
            )
        samples = trained_samples(
            self.lengths, trained, num_replicas=replicas, indices=self._subset(), **self._rules()
        )
        return progress.with_trained(samples, trained).to_state(
            "DistributedBucketSampler", replicas
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the epoch that `state` (from `state_dict`) was saved in, by a job with any
        number of ranks: iterating gives this rank its share of the samples not trained yet,
        until ``set_epoch`` moves to another epoch. Load the same state on every rank. The
        epoch and the seed become the state's.

        Raises:
            ValueError: the state is of a dataset of another length (it names samples by
                index), of a version this ringplug does not read, of another sampler, or
                damaged.
        """
        progress = EpochProgress.from_state(state, "DistributedBucketSampler", len(self.lengths))
        self.epoch, self.seed = progress.epoch, progress.seed
        self._resumed = progress
        self._cached = None
        self._yielded = 0
        replicas, _ = self._ranks()
        logger.info(
            "DistributedBucketSampler: resuming epoch %d, %d of %d samples trained (%d batches "
            "per rank, by %s ranks); %d ranks train the rest in %d batches each.",
            progress.epoch,
            int(progress.done.sum()),
            len(progress.done),
            progress.batches,
            state.get("num_replicas", "?"),
            replicas,
            len(self),
        )

    def _ranks(self) -> tuple[int, int]:
        return _ranks.resolve(self.num_replicas, self.rank)

    def _rules(self) -> dict[str, Any]:
        """The arguments of the plan besides the ranks and the samples."""
        return {
            "batch_size": self.batch_size,
            "max_tokens": self.max_tokens,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "drop_last": self.drop_last,
        }

    def _subset(self) -> np.ndarray | None:
        """The samples this epoch's plan is for: those not trained before its resume."""
        return self._resumed.remaining() if self._resumed is not None else None

    def _plan(self, epoch: int) -> Plan:
        """The epoch's plan, made once: DataLoaders and Lightning ask for len() often."""
        replicas, rank = self._ranks()
        key = (epoch, replicas, rank)
        if self._cached is None or self._cached[0] != key:
            plan = plan_batches(
                self.lengths,
                num_replicas=replicas,
                rank=rank,
                indices=self._subset() if epoch == self.epoch else None,
                **{**self._rules(), "epoch": epoch},
            )
            self._cached = (key, plan)
        return self._cached[1]

    def __iter__(self) -> Iterator[list[int]]:
        plan = self._plan(self.epoch)
        self.repeated_samples = plan.repeated_samples
        if plan.repeated_samples and not self._reported:
            self._reported = True
            logger.info(
                "DistributedBucketSampler: %d samples are repeated per epoch so that each of "
                "the %d ranks gets %d batches.",
                plan.repeated_samples,
                self._ranks()[0],
                len(plan.batches),
            )
        self._yielded = 0
        return self._counted(plan.batches)

    def _counted(self, batches: list[list[int]]) -> Iterator[list[int]]:
        for batch in batches:
            self._yielded += 1
            yield batch

    def __len__(self) -> int:
        return len(self._plan(self.epoch).batches)


def pad_collate(
    batch: list[tuple[Any, ...]], pad_value: float = 0.0, target_pad: int = 0
) -> tuple[torch.Tensor, ...]:
    """Collate (input, target sequence, *extras) samples of varying lengths.

    Inputs are padded with `pad_value` along their last dimension (an image's width, a
    sequence's time), targets with `target_pad` (0: CTC's blank). Returns ``(inputs,
    input_lengths, targets, target_lengths, *extras)``, the form CTC losses take; extras
    (sample ids, say) are stacked as tensors.
    """
    inputs = [torch.as_tensor(sample[0]) for sample in batch]
    targets = [torch.as_tensor(sample[1]).reshape(-1) for sample in batch]
    input_lengths = torch.tensor([x.shape[-1] for x in inputs], dtype=torch.int64)
    target_lengths = torch.tensor([len(t) for t in targets], dtype=torch.int64)
    width = int(input_lengths.max()) if len(batch) else 0
    padded = inputs[0].new_full((len(batch), *inputs[0].shape[:-1], width), pad_value)
    for row, x in enumerate(inputs):
        padded[row, ..., : x.shape[-1]] = x
    longest = int(target_lengths.max()) if len(batch) else 0
    labels = torch.full((len(batch), longest), target_pad, dtype=torch.int64)
    for row, t in enumerate(targets):
        labels[row, : len(t)] = t
    extras = (
        [torch.as_tensor([sample[k] for sample in batch]) for k in range(2, len(batch[0]))]
        if batch
        else []
    )
    return (padded, input_lengths, labels, target_lengths, *extras)


def global_mean_scale(count: int | torch.Tensor) -> float:
    """The factor that turns this rank's *sum* of per-sample losses into its share of the
    mean over every rank's samples, when ranks hold different numbers of samples (token-
    budget batches): ``size / total count``, from one small allreduce.

    With gradients averaged over ranks, ``loss = losses.sum() * global_mean_scale(len(x))``
    trains exactly as one process would on the union of the ranks' batches with
    ``losses.mean()``. Use token counts instead of sample counts for a per-token mean.
    """
    local = float(count)
    if not core.is_initialized() or core.size() == 1:
        return 1.0 / local if local else 0.0
    total = float(core.allreduce(np.array([local]), "sum", name="ringplug.data.count")[0])
    return core.size() / total if total else 0.0
