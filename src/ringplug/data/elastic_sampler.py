"""`ElasticSampler`: torch's ``DistributedSampler``, resumable mid-epoch by a job with as
many ranks or another number (the logic is numpy; torch gives the base class and the
shuffled order, which is ``DistributedSampler``'s)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from . import _ranks
from .progress import EpochProgress

logger = logging.getLogger(__name__)


class ElasticSampler(Sampler[int]):
    """A sampler that gives each rank its share of a dataset's samples, like torch's
    ``DistributedSampler``, and resumes a stopped epoch with the samples it has not trained,
    whether the new job has as many ranks or another number.

    Every rank gets the same number of samples: the last round is completed by repeating the
    first samples, as ``DistributedSampler`` does (or, with ``drop_last``, left out). After
    ``load_state_dict`` the samples not yet trained this epoch are dealt to the ranks of the
    new job, each once (the same padding aside); the next epoch is whole again. Use it as a
    DataLoader's ``sampler``, with the DataLoader's ``batch_size`` given to both::

        sampler = ringplug.data.ElasticSampler(dataset, batch_size=32)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        sampler.load_state_dict(checkpoint["sampler"])  # when resuming, on every rank
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            for step, batch in enumerate(loader, start=sampler.resumed_batches):
                train(batch)
                if ringplug.rank() == 0 and (step + 1) % 100 == 0:
                    save({"sampler": sampler.state_dict(step + 1), ...})

    It has Horovod's ``hvd.elastic.ElasticSampler`` methods too: `record_batch`,
    `record_indices`, `get_indices`, `reset`. Horovod gathers every rank's record when its
    state syncs; here the state of any one rank (save rank 0's) holds what every rank has
    trained, computed from the plan, which every rank can make for every rank. Only
    `record_indices` records this rank's own samples.

    Args:
        dataset: what the indices are for; only its ``len()`` is used, which must not change.
        shuffle: a new order every epoch, by (seed, epoch), the same on every rank (default
            True): a whole epoch is dealt exactly as ``DistributedSampler`` deals it, shuffled
            or not; else the samples in index order.
        seed: the order's seed, the same on every rank (default 0).
        num_replicas: the number of ranks; defaults to ringplug's world (started at first
            use under a launcher) or a single process.
        rank: this rank; defaults as `num_replicas` does.
        drop_last: leave out the last samples that would make the ranks' counts unequal,
            instead of repeating samples to fill the last round (default False).
        batch_size: the DataLoader's batch size (default None): what the batch counts of
            ``state_dict(batches_done)`` and `resumed_batches` are in. Without it, give
            ``state_dict()`` no count and call `record_batch`, or leave the count to the
            samples this rank's iterator has given out.

    Attributes:
        epoch, seed: the epoch planned, and its order's seed (`load_state_dict` sets both).
        resumed_batches: the DataLoader batches each rank had trained of this epoch before it
            was resumed (0 for an epoch that was not).
    """

    shards_by_rank = True  # a sampler of its own ranks; Lightning must not replace it

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}.")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.epoch = 0
        self._resumed: EpochProgress | None = None  # what was done of self.epoch at its resume
        self._cached: tuple[tuple[int, int, int], np.ndarray, np.ndarray] | None = None
        self._clear_records()
        replicas, rank = self._ranks()
        if not 0 <= rank < replicas:
            raise ValueError(f"rank {rank} is not in 0..{replicas - 1} (num_replicas).")

    @property
    def num_samples(self) -> int:
        """This rank's samples this epoch (``len(sampler)``)."""
        return len(self._plan()[1])

    @property
    def total_size(self) -> int:
        """All ranks' samples this epoch, padding included."""
        return len(self._plan()[0])

    @property
    def resumed_batches(self) -> int:
        """The batches each rank had trained of this epoch before its resume (else 0)."""
        return self._resumed.batches if self._resumed is not None else 0

    def set_epoch(self, epoch: int) -> None:
        """Plan `epoch` in full (call it before each epoch, or at the end of the last one as
        Horovod advises); but the epoch that `load_state_dict` resumed keeps its resumed plan
        (Lightning calls ``set_epoch`` at the start of the epoch it resumes)."""
        if epoch != self.epoch:
            self._resumed = None
            self._cached = None
            self._clear_records()
        self.epoch = epoch

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record that every rank has trained batch `batch_idx` of this iteration, and those
        before it: the batches as ``enumerate(loader)`` counts them, from 0 again after a
        resume, of `batch_size` samples each. As Horovod's, called after each batch; the
        ranks step together, so this rank's count is every rank's.
        """
        if batch_idx < 0 or batch_size < 1:
            raise ValueError(
                f"record_batch(batch_idx={batch_idx}, batch_size={batch_size}): batch_idx "
                "counts from 0 and batch_size from 1."
            )
        samples = min((batch_idx + 1) * batch_size, self.num_samples)
        self._recorded_samples = max(self._recorded_samples or 0, samples)
        self._recorded_batches = max(self._recorded_batches or 0, batch_idx + 1)

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record these samples as trained. Unlike `record_batch`, this is this rank's own
        record: a state saved by one rank holds only the indices recorded there, so gather
        them from every rank (or use `record_batch`, which needs no gathering)."""
        ids = np.fromiter((int(i) for i in indices), dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self._recorded)):
            raise ValueError(
                f"record_indices: sample ids must be in 0..{len(self._recorded) - 1}; got "
                f"{int(ids.min())}..{int(ids.max())}."
            )
        self._recorded[ids] = True

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's samples in batch `batch_idx` (of `batch_size`) of this iteration."""
        mine = self._plan()[1]
        return mine[batch_idx * batch_size : (batch_idx + 1) * batch_size].tolist()

    def reset(self) -> None:
        """Plan the rest of the epoch again, for the ranks there are now (after ranks left
        or joined, as Horovod does): what `state_dict()` counts as trained stays trained."""
        self.load_state_dict(self.state_dict())

    def state_dict(self, batches_done: int | None = None) -> dict[str, Any]:
        """This epoch's progress, for a checkpoint: the epoch, the seed and the samples that
        every rank together has trained, those before a resume included.

        The ranks' shares follow from the plan (the same seed, epoch and world on every
        rank), so any one rank's state stands for all of them: save rank 0's.

        Args:
            batches_done: the DataLoader batches (of the constructor's ``batch_size``) every
                rank has trained this epoch, counting those before a resume (Lightning's
                ``trainer.fit_loop.epoch_loop.batch_progress.current.completed``;
                ``enumerate(loader, start=sampler.resumed_batches)`` counts alike). None
                (the default) takes what `record_batch` recorded or, without a record, the
                samples this rank's iterator has given out; a DataLoader with workers takes
                batches ahead of training (``prefetch_factor`` per worker), which would then
                count as trained and be skipped after the resume. Pass the trained count, or
                call `record_batch`, when you can.

        Returns:
            A dict of ints and strings (the trained samples as a base64 bitmap, see
            `ringplug.data.progress`) that pickle, ``torch.save`` and JSON keep.

        Raises:
            ValueError: `batches_done` without a ``batch_size``, or fewer batches than were
                trained before the resume, or more than the epoch has.
        """
        replicas, _ = self._ranks()
        order, mine = self._plan()
        progress = self._resumed or EpochProgress.fresh(self.epoch, self.seed, self._length())
        if batches_done is not None:
            samples, batches = self._samples_of(batches_done, progress.batches, len(mine))
        elif self._recorded_samples is not None:
            samples, batches = self._recorded_samples, self._recorded_batches or 0
        else:
            samples = self._yielded
            batches = math.ceil(samples / self.batch_size) if self.batch_size else 0
        # Rank r's k-th sample is order[k * replicas + r]: the first rounds of the deal.
        trained = np.union1d(order[: samples * replicas], np.flatnonzero(self._recorded))
        return progress.with_trained(trained, batches).to_state("ElasticSampler", replicas)

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
        progress = EpochProgress.from_state(state, "ElasticSampler", self._length())
        self.epoch, self.seed = progress.epoch, progress.seed
        self._resumed = progress
        self._cached = None
        self._clear_records()
        replicas, _ = self._ranks()
        logger.info(
            "ElasticSampler: resuming epoch %d, %d of %d samples trained (by %s ranks); %d "
            "ranks train the rest, %d samples each.",
            progress.epoch,
            int(progress.done.sum()),
            len(progress.done),
            state.get("num_replicas", "?"),
            replicas,
            self.num_samples,
        )

    def __iter__(self) -> Iterator[int]:
        mine = self._plan()[1]
        self._yielded = 0
        return self._counted(mine.tolist())

    def __len__(self) -> int:
        return self.num_samples

    def _counted(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self._yielded += 1
            yield index

    def _samples_of(self, batches_done: int, before: int, per_rank: int) -> tuple[int, int]:
        """This rank's samples in `batches_done` batches of the epoch (`before` of them
        before the resume), and the batches of this plan among them."""
        if self.batch_size is None:
            raise ValueError(
                "ElasticSampler.state_dict(batches_done=...) counts the DataLoader's batches: "
                "give ElasticSampler(..., batch_size=...) the DataLoader's batch_size, or call "
                "record_batch(batch_idx, batch_size) after each batch and state_dict() alone."
            )
        batches = batches_done - before
        most = math.ceil(per_rank / self.batch_size)
        if not 0 <= batches <= most:
            raise ValueError(
                f"ElasticSampler.state_dict: batches_done={batches_done}, but epoch "
                f"{self.epoch} has {before + most} batches of {self.batch_size} per rank, "
                f"{before} of them trained before its resume. batches_done counts the epoch's "
                f"batches so far, those before the resume included: give one from {before} "
                f"to {before + most}."
            )
        return min(batches * self.batch_size, per_rank), batches

    def _clear_records(self) -> None:
        self._recorded_samples: int | None = None  # per rank, by record_batch
        self._recorded_batches: int | None = None
        self._recorded = np.zeros(self._length(), dtype=bool)  # by record_indices
        self._yielded = 0  # samples the latest iterator has given out

    def _length(self) -> int:
        return len(self.dataset)

    def _ranks(self) -> tuple[int, int]:
        return _ranks.resolve(self.num_replicas, self.rank)

    def _plan(self) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's samples in the order they are dealt (rank r takes
        ``[r::num_replicas]``), padding included, and this rank's; made once an epoch."""
        replicas, rank = self._ranks()
        key = (self.epoch, replicas, rank)
        if self._cached is None or self._cached[0] != key:
            if self._resumed is not None:
                remaining = self._resumed.remaining()
            else:
                remaining = np.arange(self._length())
            if self.shuffle:
                # DistributedSampler's order (torch's generator, seeded seed + epoch): a whole
                # epoch deals exactly as it does, so this sampler can stand in for it.
                generator = torch.Generator()
                generator.manual_seed(self.seed + self.epoch)
                shuffled = torch.randperm(len(remaining), generator=generator).numpy()
                remaining = remaining[shuffled]
            if self.drop_last:
                order = remaining[: len(remaining) - len(remaining) % replicas]
            elif len(remaining):
                # Like DistributedSampler: the first samples again, as often as needed.
                padding = np.resize(remaining, -len(remaining) % replicas)
                order = np.concatenate([remaining, padding])
            else:
                order = remaining
            self._cached = (key, order, order[rank::replicas])
        return self._cached[1], self._cached[2]
