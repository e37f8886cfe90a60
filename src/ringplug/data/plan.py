"""Framework-neutral batch plans for variable-length data (numpy only).

A plan is made in three steps, from the global index order, so that every rank computes
the same plan and takes its own share of it:

1. Order: the indices, shuffled by (seed, epoch) when asked.
2. Batches: the order is cut into pools of many batches' worth of samples; each pool is
   sorted by length and cut into batches of similar lengths (a fixed batch size, or as
   many samples as fit a budget of padded elements: longest length x count). Pools keep
   the shuffle's randomness while keeping padding low. The batch order is then shuffled.
3. Shards: whole batches are dealt to the ranks in turn. When the batch count does not
   divide by the number of ranks, the last round is completed with batches that repeat
   earlier samples (or, with ``drop_last``, dropped), so every rank gets the same number of
   batches: a rank with one batch more would wait forever in its last gradient reduction.

A plan can be made for a subset of the samples (``indices``): the rest of an epoch that was
stopped and is resumed, perhaps by another number of ranks. `trained_samples` says which
samples the ranks' first batches of a plan hold together: what a checkpoint of the epoch's
progress records (the samplers' ``state_dict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

_POOL_BATCHES = 64  # batches' worth of samples sorted together


@dataclasses.dataclass(frozen=True)
class Plan:
    """One rank's batches for one epoch, and what it took to make the counts equal."""

    batches: list[list[int]]  # this rank's batches, in order
    total_batches: int  # over all ranks, padding included
    repeated_samples: int  # samples in the padding batches (0 with drop_last)
    dropped_samples: int  # samples left out (drop_last)


def plan_batches(
    lengths: Sequence[int] | np.ndarray,
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    num_replicas: int = 1,
    rank: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    indices: Sequence[int] | np.ndarray | None = None,
) -> Plan:
    """This rank's batches for `epoch` (see the module docstring).

    Args:
        lengths: each sample's length (tokens, frames, pixels of width...).
        batch_size: samples per batch; or
        max_tokens: padded elements per batch (longest length in the batch x samples).
        num_replicas: the number of ranks.
        rank: this rank.
        shuffle: shuffle the order by (seed, epoch).
        seed: the shuffle's seed, the same on every rank.
        epoch: the epoch, which changes the shuffled order.
        drop_last: drop the batches that would make the counts unequal instead of adding
            batches of repeated samples.
        indices: plan only these samples (ids into `lengths`, each at most once), in this
            order unless shuffled: the rest of a resumed epoch. None (the default) plans
            them all; ``indices=range(len(lengths))`` gives the same plan.
    """
    sizes = np.asarray(lengths, dtype=np.int64).reshape(-1)
    _check(sizes, batch_size, max_tokens, num_replicas, rank)
    subset = _subset(sizes, indices)
    batches, repeated, dropped = _deal(
        sizes, subset, batch_size, max_tokens, num_replicas, shuffle, seed, epoch, drop_last
    )
    return Plan(batches[rank::num_replicas], len(batches), repeated, dropped)


def trained_samples(
    lengths: Sequence[int] | np.ndarray,
    batches: int,
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    num_replicas: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    indices: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """The samples that all ranks together have trained once each rank has trained the
    first `batches` of its batches in the plan that `plan_batches` makes from the same
    arguments: sorted sample ids, each once (a sample in a padding batch is counted once).

    Any rank can compute it, for every rank, with nothing exchanged: the ranks of a data-
    parallel job step together, so one count stands for all of them. A sample counts only
    when a batch holding it was trained: the padding batches repeat samples of the first
    round, so a repeat never marks a sample that is still to come.

    Raises:
        ValueError: `batches` is negative or more than each rank's batch count.
    """
    sizes = np.asarray(lengths, dtype=np.int64).reshape(-1)
    _check(sizes, batch_size, max_tokens, num_replicas, 0)
    subset = _subset(sizes, indices)
    every, _, _ = _deal(
        sizes, subset, batch_size, max_tokens, num_replicas, shuffle, seed, epoch, drop_last
    )
    per_rank = len(every) // num_replicas
    if not 0 <= batches <= per_rank:
        raise ValueError(
            f"batches={batches}, but this plan has {per_rank} batches per rank; give a count "
            f"between 0 and {per_rank}."
        )
    # Rank r's j-th batch is every[j * num_replicas + r]: the first rounds of the deal.
    held = [i for batch in every[: batches * num_replicas] for i in batch]
    return np.unique(np.asarray(held, dtype=np.int64))


def _subset(sizes: np.ndarray, indices: Sequence[int] | np.ndarray | None) -> np.ndarray | None:
    """`indices` as an int64 array, checked: ids of samples, none twice."""
    if indices is None:
        return None
    subset = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(subset) and (subset.min() < 0 or subset.max() >= len(sizes)):
        raise ValueError(
            f"indices must be sample ids in 0..{len(sizes) - 1} (there are {len(sizes)} "
            f"lengths); got {int(subset.min())}..{int(subset.max())}."
        )
    if len(np.unique(subset)) != len(subset):
        raise ValueError(
            "indices name some samples more than once; each sample of the subset must be "
            "planned once (remove the repeats)."
        )
    return subset


def _deal(
    sizes: np.ndarray,
    subset: np.ndarray | None,
    batch_size: int | None,
    max_tokens: int | None,
    num_replicas: int,
    shuffle: bool,
    seed: int,
    epoch: int,
    drop_last: bool,
) -> tuple[list[list[int]], int, int]:
    """Every rank's batches in the order they are dealt (rank r takes ``[r::num_replicas]``),
    padding included; and the samples repeated and dropped to make the counts equal."""
    rng = np.random.default_rng([seed, epoch])
    if subset is None:
        order = rng.permutation(len(sizes)) if shuffle else np.arange(len(sizes))
    else:
        # For the full subset in id order this draws what the full plan draws, so a resume
        # from nothing done gives the plan the epoch had.
        order = subset[rng.permutation(len(subset))] if shuffle else subset
    batches = _cut(order, sizes, batch_size, max_tokens)
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    leftover = len(batches) % num_replicas
    repeated = dropped = 0
    if leftover and drop_last:
        dropped = sum(len(b) for b in batches[len(batches) - leftover :])
        batches = batches[: len(batches) - leftover]
    elif leftover:
        extra = [list(batches[i % len(batches)]) for i in range(num_replicas - leftover)]
        repeated = sum(len(b) for b in extra)
        batches = batches + extra
    return batches, repeated, dropped


def _check(
    sizes: np.ndarray, batch_size: int | None, max_tokens: int | None, num_replicas: int, rank: int
) -> None:
    if (batch_size is None) == (max_tokens is None):
        raise ValueError(
            "give exactly one of batch_size (samples per batch) and max_tokens "
            "(padded elements per batch)."
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}.")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in 0..{num_replicas - 1} (num_replicas).")
    if len(sizes) and sizes.min() < 0:
        raise ValueError("lengths must not be negative.")
    if max_tokens is not None and len(sizes) and sizes.max() > max_tokens:
        longest = int(np.argmax(sizes))
        raise ValueError(
            f"sample {longest} has length {int(sizes[longest])}, more than "
            f"max_tokens={max_tokens}; raise max_tokens to at least that."
        )


def _cut(
    order: np.ndarray, sizes: np.ndarray, batch_size: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Batches of similar lengths, pool by pool."""
    if batch_size is not None:
        pool = batch_size * _POOL_BATCHES
    else:
        typical = max(int(np.median(sizes[order])) if len(order) else 1, 1)
        pool = max(max_tokens // typical, 1) * _POOL_BATCHES  # type: ignore[operator]
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = order[start : start + pool]
        chunk = chunk[np.argsort(sizes[chunk], kind="stable")]
        if batch_size is not None:
            batches.extend(
                chunk[i : i + batch_size].tolist() for i in range(0, len(chunk), batch_size)
            )
            continue
        current: list[int] = []
        longest = 0
        for index in chunk.tolist():
            grown = max(longest, int(sizes[index]))
            if current and grown * (len(current) + 1) > max_tokens:  # type: ignore[operator]
                batches.append(current)
                current, grown = [], int(sizes[index])
            current.append(index)
            longest = grown
        if current:
            batches.append(current)
    return batches


def pad_numpy(
    samples: Sequence[tuple], pad_value: float = 0.0, target_pad: int = 0
) -> tuple[np.ndarray, ...]:
    """Collate (input, target sequence, *extras) samples of varying lengths with numpy:
    ``(inputs, input_lengths, targets, target_lengths, *extras)``, inputs padded with
    `pad_value` along their last dimension and targets with `target_pad` (the layout of
    `ringplug.data.pad_collate`)."""
    inputs = [np.asarray(sample[0]) for sample in samples]
    targets = [np.asarray(sample[1]).reshape(-1) for sample in samples]
    input_lengths = np.array([x.shape[-1] for x in inputs], dtype=np.int64)
    target_lengths = np.array([len(t) for t in targets], dtype=np.int64)
    padded = np.full(
        (len(inputs), *inputs[0].shape[:-1], input_lengths.max()), pad_value, dtype=inputs[0].dtype
    )
    for row, x in enumerate(inputs):
        padded[row, ..., : x.shape[-1]] = x
    labels = np.full((len(targets), target_lengths.max()), target_pad, dtype=np.int64)
    for row, t in enumerate(targets):
        labels[row, : len(t)] = t
    extras = [np.asarray([sample[k] for sample in samples]) for k in range(2, len(samples[0]))]
    return (padded, input_lengths, labels, target_lengths, *extras)
