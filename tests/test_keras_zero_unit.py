"""Keras ``DistributedOptimizer(..., zero=1)`` in one process: what it refuses, the deal, and a
world of one (where the sharded optimizer is the plain one, saved and loaded as such)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
pytest.importorskip(keras.backend.backend())

import ringplug.keras as rk  # noqa: E402
from ringplug.keras import sharding  # noqa: E402


@pytest.fixture(autouse=True)
def world_of_one():
    rk.init()  # this process alone: rank 0 of 1


def make_model(seed: int = 3) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)]
    )


def test_the_deal_balances_equal_tensors_and_leaves_ranks_empty_when_there_are_few():
    assert sharding.partition([100] * 6, 3) == [0, 1, 2, 0, 1, 2]
    assert sharding.partition([10, 1000], 3) == [1, 0]  # rank 2 owns nothing


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), "mixed_bfloat16"),
        (lambda: _built(keras.optimizers.Adam(0.01)), "before compile"),
        (lambda: keras.optimizers.Adafactor(0.01), "Adam/AdamW with zero=1"),
    ],
    ids=["loss-scale", "built", "adafactor"],
)
def test_an_optimizer_that_cannot_be_sharded_is_refused_with_what_to_use(make, says):
    with pytest.raises(ValueError, match="zero=1") as error:
        rk.DistributedOptimizer(make(), zero=1)
    assert says in str(error.value)


def test_an_optimizer_with_its_own_apply_is_refused():
    class WholeModel(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):  # looks at every variable at once
            return super().apply(grads, trainable_variables)

    with pytest.raises(ValueError, match="defines its own apply"):
        rk.DistributedOptimizer(WholeModel(0.1), zero=1)


def test_zero_other_than_0_or_1_is_refused():
    with pytest.raises(ValueError, match="zero must be 0"):
        rk.DistributedOptimizer(keras.optimizers.SGD(0.1), zero=2)


def test_mixed_float16_is_refused_when_the_optimizer_is_built():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        optimizer = rk.DistributedOptimizer(keras.optimizers.SGD(0.1), zero=1)
        with pytest.raises(ValueError, match="mixed_bfloat16"):
            optimizer.build(make_model().trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _built(optimizer):
    optimizer.build(make_model().trainable_variables)
    return optimizer


def _fit(zero: int) -> keras.Model:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    model = make_model()
    optimizer = keras.optimizers.Adam(0.01, global_clipnorm=0.1)
    if zero is not None:
        optimizer = rk.DistributedOptimizer(optimizer, zero=zero)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model


def test_in_a_world_of_one_the_sharded_optimizer_saves_what_the_plain_one_saves(tmp_path):
    plain, sharded = _fit(None), _fit(1)
    assert sharding.is_sharded(sharded.optimizer)
    for a, b in zip(plain.weights, sharded.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    sharded.save(tmp_path / "one.keras")  # no consolidate needed: one rank holds it all
    loaded = keras.models.load_model(tmp_path / "one.keras")
    assert not hasattr(loaded.optimizer, "_ringplug")
    expected = [keras.ops.convert_to_numpy(v) for v in plain.optimizer.variables]
    found = [keras.ops.convert_to_numpy(v) for v in loaded.optimizer.variables]
    assert len(found) == len(expected)
    for a, b in zip(found, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_whole_state_loads_into_a_sharded_optimizer(tmp_path):
    plain = _fit(None)
    plain.save_weights(tmp_path / "plain.weights.h5")
    model = make_model(seed=9)
    model.compile(
        optimizer=rk.DistributedOptimizer(keras.optimizers.Adam(0.01), zero=1), loss="mse"
    )
    model.optimizer.build(model.trainable_variables)
    model.load_weights(tmp_path / "plain.weights.h5")
    for a, b in zip(plain.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


def test_what_zero_1_overrides_is_declared_and_exists_in_this_keras():
    from ringplug import _patching
    from ringplug.keras import patches

    assert patches.overridden(sharding.ShardedApply) == sorted(patches.SHARDED_OVERRIDES)
    assert _patching.absent(patches.targets()) == []


def test_an_elastic_state_refuses_a_sharded_optimizer():
    from ringplug.keras import elastic

    model = make_model()
    model.compile(
        optimizer=rk.DistributedOptimizer(keras.optimizers.Adam(0.01), zero=1), loss="mse"
    )
    with pytest.raises(ValueError, match="BackupAndRestore"):
        elastic.KerasState(model, epoch=0)
