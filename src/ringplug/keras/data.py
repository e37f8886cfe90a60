"""Shard input pipelines so that every rank gets its own samples and the same step count.

Equal step counts matter: a rank with one batch more would wait forever in that batch's
gradient reduction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from .. import core
from ..data.plan import pad_numpy
from ._inputs import BucketedInput


def shard(dataset: Any, rank: int | None = None, size: int | None = None) -> Any:
    """This rank's share of a ``tf.data.Dataset`` of samples: apply it before shuffling and
    batching, so that each rank shuffles and batches its own samples.

    Every rank gets ``len(dataset) // size`` samples; the at most ``size - 1`` left over are
    dropped (and said so), so that every rank runs the same number of steps. An infinite
    dataset is sharded as it is (set ``steps_per_epoch``). A dataset whose length TensorFlow
    cannot know (after ``filter``, say) is refused: equal steps cannot be promised up front,
    so either state the length with ``tf.data.experimental.assert_cardinality(n)``, or
    ``repeat()`` it and give ``fit`` a ``steps_per_epoch`` that every rank can serve.

    Example:
        >>> ds = ringplug.keras.shard(tf.data.Dataset.from_tensor_slices((x, y)))  # doctest: +SKIP
        >>> ds = ds.shuffle(1000, seed=epoch_seed).batch(32)
    """
    import tensorflow as tf

    rank = core.rank() if rank is None else rank
    size = core.size() if size is None else size
    if size == 1:
        return dataset
    count = int(dataset.cardinality())
    if count == tf.data.INFINITE_CARDINALITY:
        return dataset.shard(size, rank)
    if count == tf.data.UNKNOWN_CARDINALITY:
        raise ValueError(
            "ringplug.keras.shard: the length of this dataset is unknown, so the ranks "
            "cannot be given equal step counts up front (a rank with a batch more would "
            "hang in its last reduction). State it with dataset.apply(tf.data.experimental."
            "assert_cardinality(n)), or repeat() the dataset and pass fit(steps_per_epoch=...)."
        )
    each = count // size
    if count % size and rank == 0:
        logging.getLogger("ringplug").warning(
            "shard: %d samples over %d ranks; dropping the last %d so every rank gets %d.",
            count,
            size,
            count - each * size,
            each,
        )
    return dataset.shard(size, rank).take(each)


class ShardedPyDataset(keras.utils.PyDataset):
    """This rank's share of a ``keras.utils.PyDataset`` (which yields whole batches).

    Rank r gets batches r, r + N, r + 2N, ... of the dataset, ``len(dataset) // N`` of them,
    so every rank runs the same number of steps (the at most N - 1 batches left over are
    skipped). Shuffle inside the wrapped dataset's ``on_epoch_end``, with the same seed on
    every rank, so that the ranks' shares stay disjoint.
    """

    def __init__(
        self,
        dataset: keras.utils.PyDataset,
        rank: int | None = None,
        size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.dataset = dataset
        self.rank = core.rank() if rank is None else rank
        self.size = core.size() if size is None else size

    def __len__(self) -> int:
        return len(self.dataset) // self.size

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} of {len(self)}")
        return self.dataset[index * self.size + self.rank]

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()


def bucketed_dataset(
    load: Callable[[int], tuple],
    lengths: Sequence[int] | np.ndarray,
    output_signature: Any,
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    collate: Callable[[list[tuple]], tuple] = pad_numpy,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> Any:
    """A ``tf.data.Dataset`` of this rank's padded batches of similar lengths, the same
    number on every rank: `ringplug.data.DistributedBucketSampler`'s plan for tf.data.

    Bucketing after sharding would give each rank its own length mix and so its own batch
    count (the last reduction would then hang); here the batches are formed from the global
    index order first and whole batches are dealt to the ranks.

    Args:
        load: sample index -> a sample, e.g. ``(image, label_sequence, index)``.
        lengths: each sample's length (what padding pads).
        output_signature: the ``tf.TensorSpec`` tuple of one collated batch.
        batch_size: samples per batch, as for the sampler; or
        max_tokens: padded elements per batch, as for the sampler.
        shuffle: as for the sampler.
        seed: as for the sampler.
        drop_last: as for the sampler.
        collate: samples -> batch arrays; defaults to `ringplug.data.pad_numpy`
            ``(inputs, input_lengths, targets, target_lengths, *extras)``.

    With ``batch_size`` the dataset's length is known (the same every epoch). With
    ``max_tokens`` it varies a little from epoch to epoch (equal on every rank) and is left
    unknown; Keras then takes the first epoch's count for the later ones, ending an epoch
    early or leaving its last batches out, alike on every rank (it warns that the input
    "ran out of data"). Use ``batch_size`` where every epoch must see every sample.

    In a ``fit`` with `RingBroadcast` or `ringplug.keras.BackupAndRestore`, each pass takes
    the fit's epoch (a fit resumed at epoch 3 gets epoch 3's order); elsewhere the passes
    count epochs from 0. A backup written mid-epoch by `ringplug.keras.BackupAndRestore`
    holds the epoch's position here: after the restore the epoch's untrained samples are
    dealt to the ranks there are now, each once, and the epoch ends after them.
    """
    import tensorflow as tf

    rules = {"batch_size": batch_size, "max_tokens": max_tokens, "shuffle": shuffle,
             "seed": seed, "drop_last": drop_last}  # fmt: skip
    source = BucketedInput(lengths, rules, core.size(), core.rank())

    def batches() -> Any:
        current = source.start_pass()
        for batch in current.batches + source.fillers(current):
            yield collate([load(i) for i in batch])

    dataset = tf.data.Dataset.from_generator(batches, output_signature=output_signature)
    if batch_size is not None:
        cardinality = tf.data.experimental.assert_cardinality(source.full_batches)
        dataset = dataset.apply(cardinality)
    return dataset.prefetch(2)
