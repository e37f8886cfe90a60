"""ringplug.keras pieces that need no second rank: sharding, the warmup schedule, errors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import ringplug.keras as rk  # noqa: E402


def elements(dataset) -> list[int]:
    return [int(v) for v in dataset.as_numpy_iterator()]


@pytest.mark.parametrize("count", [11, 12, 1])
def test_shard_gives_every_rank_as_many_disjoint_samples(count):
    size = 3
    shards = [
        elements(rk.shard(tf.data.Dataset.range(count), rank=r, size=size)) for r in range(size)
    ]
    assert [len(s) for s in shards] == [count // size] * size
    flat = [v for s in shards for v in s]
    assert len(set(flat)) == len(flat) and set(flat) <= set(range(count))


def test_shard_refuses_a_dataset_of_unknown_length_and_says_what_to_do():
    unknown = tf.data.Dataset.range(10).filter(lambda v: v % 2 == 0)
    with pytest.raises(ValueError, match="assert_cardinality"):
        rk.shard(unknown, rank=0, size=2)
    known = unknown.apply(tf.data.experimental.assert_cardinality(5))
    assert elements(rk.shard(known, rank=1, size=2)) == [2, 6]


class Batches(keras.utils.PyDataset):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.epochs = 0

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        return np.full((2, 1), index, np.float32), np.zeros((2, 1), np.float32)

    def on_epoch_end(self) -> None:
        self.epochs += 1


def test_sharded_pydataset_gives_every_rank_the_same_number_of_distinct_batches():
    base = Batches(7)
    shards = [rk.ShardedPyDataset(base, rank=r, size=3) for r in range(3)]
    assert [len(s) for s in shards] == [2, 2, 2]
    seen = [int(s[i][0][0, 0]) for s in shards for i in range(len(s))]
    assert sorted(seen) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(IndexError):
        shards[0][2]
    shards[0].on_epoch_end()
    assert base.epochs == 1


def test_warmup_schedule_climbs_from_one_nth_and_survives_serialization():
    after = keras.optimizers.schedules.ExponentialDecay(0.4, decay_steps=10, decay_rate=0.5)
    schedule = rk.WarmupSchedule(after, warmup_steps=8, size=4)
    for step in (0, 4, 8, 20):
        fraction = min(step / 8, 1.0)
        expected = float(after(step)) * (0.25 + 0.75 * fraction)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-6)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert isinstance(restored, rk.WarmupSchedule)
    assert [float(restored(s)) for s in (0, 5, 30)] == pytest.approx(
        [float(schedule(s)) for s in (0, 5, 30)]
    )


def test_ring_warmup_explains_what_to_do_with_a_schedule():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    with pytest.raises(TypeError, match="WarmupSchedule"):
        model.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0, callbacks=[rk.RingWarmup(1)])


def test_distributed_optimizer_refuses_bad_settings():
    rk.init()
    with pytest.raises(ValueError, match="compression"):
        rk.DistributedOptimizer(keras.optimizers.SGD(), compression="gzip")
    with pytest.raises(ValueError, match="Average or Sum"):
        rk.DistributedOptimizer(keras.optimizers.SGD(), op="max")
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3"):
        rk.DistributedOptimizer(
            keras.optimizers.SGD(gradient_accumulation_steps=3), backward_passes_per_step=2
        )


def test_world_of_one_helpers():
    assert rk.scale_lr(0.1) == pytest.approx(0.1)
    marker = keras.callbacks.Callback()
    assert rk.on_rank_zero(marker) == [marker]
    assert rk.verbose(2) == 2


def test_a_local_variables_key_survives_its_assignment_on_every_backend():
    # PartialDistributedOptimizer keeps the gradients of local variables by these keys from
    # step to step; on JAX a Keras variable's value is a new array after each assignment.
    pytest.importorskip("jax")
    script = (
        "import keras, numpy as np\n"
        "from ringplug.keras.optimizer import _key\n"
        "v = keras.Variable(np.zeros(3, 'float32'))\n"
        "before = _key(v)\n"
        "v.assign(np.ones(3, 'float32'))\n"
        "print(before == _key(v))\n"
    )
    for backend in ("jax", "tensorflow"):
        result = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "KERAS_BACKEND": backend},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.stdout.strip().splitlines()[-1:] == ["True"], backend + result.stderr


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.AdamW(weight_decay=0.1),
        lambda: keras.optimizers.SGD(momentum=0.9, weight_decay=0.1, use_ema=True),
        lambda: keras.optimizers.Lion(weight_decay=0.1),
        lambda: keras.optimizers.Adam(weight_decay=0.1, gradient_accumulation_steps=2),
    ],
    ids=["AdamW", "SGD-ema", "Lion", "Adam-accumulating"],
)
def test_building_the_optimizer_before_a_broadcast_moves_no_weight(make):
    # What RingBroadcast, BackupAndRestore and KerasState do where torch's Horovod layer
    # takes a zero-gradient step: Keras builds the slots without applying anything, so
    # weight decay has nothing to move.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = rk.DistributedOptimizer(make())
    before = [keras.ops.convert_to_numpy(w).copy() for w in model.weights]
    optimizer.build(model.trainable_variables)
    after = [keras.ops.convert_to_numpy(w) for w in model.weights]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after, strict=True))
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 0


def test_check_agreement_of_a_world_of_one_agrees_and_checksums_see_every_word():
    from ringplug.agreement import numpy_checksum

    rk.init()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    rk.check_agreement(model, where="alone")
    words = np.arange(7, dtype=np.float32)  # 28 bytes: three whole words and a half
    for index in range(words.size):
        changed = words.copy()
        changed[index] = np.nextafter(changed[index], np.float32(np.inf))
        assert numpy_checksum(changed) != numpy_checksum(words)
    nan = np.array([np.nan, 1.0])
    assert numpy_checksum(nan) == numpy_checksum(nan.copy())  # NaN != NaN, but its bits agree
