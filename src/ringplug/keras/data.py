"""Shard input pipelines so that every rank gets its own samples and the same step count.

Equal step counts matter: a rank with one batch more would wait forever in that batch's
gradient reduction.
"""

from __future__ import annotations

import logging
from typing import Any

import keras

from .. import core


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
            count, size, count - each * size, each,
        )  # fmt: skip
    return dataset.shard(size, rank).take(each)


class ShardedPyDataset(keras.utils.PyDataset):
    """This rank's share of a ``keras.utils.PyDataset`` (which yields whole batches).

    Rank r gets batches r, r + N, r + 2N, ... of the dataset, ``len(dataset) // N`` of them,
    so every rank runs the same number of steps (the at most N - 1 batches left over are
    skipped). Shuffle inside the wrapped dataset's ``on_epoch_end``, with the same seed on
    every rank, so that the ranks' shares stay disjoint.
    """

    def __init__(self, dataset: keras.utils.PyDataset, rank: int | None = None,
                 size: int | None = None, **kwargs: Any) -> None:  # fmt: skip
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
