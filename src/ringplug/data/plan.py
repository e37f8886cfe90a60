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
) -> Plan:
    """This rank's batches for `epoch` (see the module docstring).

    Args:
        lengths: each sample's length (tokens, frames, pixels of width...).
        batch_size: samples per batch; or
        max_tokens: padded elements per batch (longest length in the batch x samples).
        num_replicas, rank: the ranks, and this one.
        shuffle, seed, epoch: the order is shuffled by (seed, epoch) when `shuffle`.
        drop_last: drop the batches that would make the counts unequal instead of adding
            batches of repeated samples.
    """
    sizes = np.asarray(lengths, dtype=np.int64).reshape(-1)
    _check(sizes, batch_size, max_tokens, num_replicas, rank)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(sizes)) if shuffle else np.arange(len(sizes))
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
    return Plan(batches[rank::num_replicas], len(batches), repeated, dropped)


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
        typical = max(int(np.median(sizes)) if len(sizes) else 1, 1)
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
