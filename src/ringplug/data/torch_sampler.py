"""`DistributedBucketSampler` and `pad_collate`: variable-length data for torch DataLoaders."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from .. import core
from .plan import Plan, plan_batches


class DistributedBucketSampler(BatchSampler):
    """A batch sampler that gives each rank whole samples, in batches of similar lengths,
    and the same number of batches on every rank.

    Use it as a DataLoader's ``batch_sampler`` (with `pad_collate` as ``collate_fn``)::

        sampler = DistributedBucketSampler(dataset.lengths, max_tokens=32 * 400)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate)

    Under ``ringrun`` with a plain DataLoader, or in ``Trainer(strategy="ring")`` (where
    Lightning leaves it alone, wherever the DataLoader was made), each rank reads its own
    batches. Call ``set_epoch(e)`` each epoch (Lightning does) for a new order.

    Args:
        lengths: each sample's length (tokens, frames, pixels of width...).
        batch_size: samples per batch; or
        max_tokens: a budget of padded elements per batch (longest length x samples), for
            batches with as many short samples or as few long ones as fit.
        num_replicas, rank: default to ringplug's world (started at first use under a
            launcher) or a single process.
        shuffle, seed: the order changes every epoch, the same on every rank.
        drop_last: drop the batches that would make the ranks' counts unequal instead of
            completing the last round with repeated samples.
        sampler: set by Lightning's sampler injection (a ``DistributedSampler``); only its
            ranks are used.

    Attributes:
        repeated_samples: samples repeated this epoch to equalize the counts (logged once).
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
        self._plan(0)  # check the arguments now, not at the first batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _ranks(self) -> tuple[int, int]:
        if self.num_replicas is not None:
            return self.num_replicas, self.rank if self.rank is not None else 0
        if not core.is_initialized() and core.runtime.launcher_world_size() is not None:
            core.init()  # under a launcher: the world is the job's
        if core.is_initialized():
            return core.size(), core.rank() if self.rank is None else self.rank
        return 1, 0

    def _plan(self, epoch: int) -> Plan:
        """The epoch's plan, made once: DataLoaders and Lightning ask for len() often."""
        replicas, rank = self._ranks()
        key = (epoch, replicas, rank)
        if self._cached is None or self._cached[0] != key:
            plan = plan_batches(
                self.lengths,
                batch_size=self.batch_size,
                max_tokens=self.max_tokens,
                num_replicas=replicas,
                rank=rank,
                shuffle=self.shuffle,
                seed=self.seed,
                epoch=epoch,
                drop_last=self.drop_last,
            )
            self._cached = (key, plan)
        return self._cached[1]

    def __iter__(self) -> Iterator[list[int]]:
        plan = self._plan(self.epoch)
        self.repeated_samples = plan.repeated_samples
        if plan.repeated_samples and not self._reported:
            self._reported = True
            logging.getLogger("ringplug").info(
                "DistributedBucketSampler: %d samples are repeated per epoch so that each of "
                "the %d ranks gets %d batches.",
                plan.repeated_samples,
                self._ranks()[0],
                len(plan.batches),
            )
        return iter(plan.batches)

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
