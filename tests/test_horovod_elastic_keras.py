"""``hvd.elastic`` for Keras 3 and TensorFlow on ringrun's restarts: what `KerasState`,
`TensorFlowState` and the state callbacks keep and give back (in one process), and the two
styles of Horovod's elastic TensorFlow 2 examples (``model.fit`` with the callbacks, a
``GradientTape`` loop) on 3 ranks that lose one, restarted by ringrun on 2 from the last
commit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from launch import discovery_script, processes_matching, run_ringrun, unique_marker

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("these tests run Keras on its TensorFlow backend", allow_module_level=True)

import ringplug.horovod.keras as hvd  # noqa: E402
import ringplug.horovod.tensorflow as hvd_tf  # noqa: E402
from ringplug import elastic as _elastic  # noqa: E402

WORKER = str(Path(__file__).parent / "workers" / "hvd_elastic_keras.py")


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch, tmp_path):
    hvd.init()
    for name in ("RINGPLUG_RESTART", "RINGPLUG_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RINGPLUG_ELASTIC_DIR", str(tmp_path / "commits"))
    monkeypatch.setattr(_elastic, "_resumed", False)


def compiled_model(units: int = 2, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.1)), loss="mse")
    return model


def train(model: keras.Model, steps: int = 2, **fit) -> None:
    features = np.linspace(0, 1, 24, dtype="float32").reshape(8, 3)
    targets = np.ones((8, model.output_shape[-1]), "float32")
    model.fit(features, targets, batch_size=4, epochs=steps // 2, verbose=0, **fit)


def values(variables) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(v).copy() for v in variables]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------ KerasState
def test_keras_state_restore_gives_back_weights_optimizer_slots_and_step_count():
    model = compiled_model()
    state = hvd.elastic.KerasState(model, batch=0, epoch=1)
    train(model)
    state.commit()
    weights, slots = values(model.weights), values(model.optimizer.variables)
    train(model)
    state.epoch = 2
    assert not same(values(model.weights), weights)
    state.restore()
    assert same(values(model.weights), weights)
    assert same(values(model.optimizer.variables), slots)  # Adam's moments, iterations, lr
    assert int(model.optimizer.iterations.numpy()) == 2 and state.epoch == 1


def test_keras_state_builds_an_optimizer_that_has_not_stepped_yet():
    model = compiled_model()
    assert not model.optimizer.built
    state = hvd.elastic.KerasState(model, epoch=0)
    assert state.optimizer is model.optimizer and model.optimizer.built
    assert len(model.optimizer.variables) == 2 + 2 * len(model.trainable_variables)


def test_a_restarted_job_resumes_into_a_model_and_optimizer_that_never_trained(monkeypatch):
    first = compiled_model(seed=0)
    train(first)
    state = hvd.elastic.KerasState(first, epoch=3)
    state.commit()
    # A new process of the restarted job: new objects, nothing trained, the commit on disk.
    monkeypatch.setenv("RINGPLUG_RESTART", "1")
    second = compiled_model(seed=1)
    resets = []
    resumed = hvd.elastic.KerasState(second, epoch=0)
    resumed.register_reset_callbacks([lambda: resets.append(hvd.size())])
    epoch = hvd.elastic.run(lambda s: s.epoch)(resumed)
    assert epoch == 3 and resets == []  # as many ranks as at the commit: no reset
    assert same(values(second.weights), values(first.weights))
    assert same(values(second.optimizer.variables), values(first.optimizer.variables))


def test_a_commit_from_another_model_is_refused_and_changes_nothing(monkeypatch):
    other = compiled_model(units=2)
    hvd.elastic.KerasState(other, epoch=3).commit()
    monkeypatch.setenv("RINGPLUG_RESTART", "1")
    model = compiled_model(units=5)
    before = values(model.weights)
    state = hvd.elastic.KerasState(model, epoch=0)
    with pytest.raises(ValueError, match=r"does not fit state\.model \(variable 0 is ") as error:
        hvd.elastic.run(lambda s: None)(state)
    assert "of shape (3, 2) in the commit" in str(error.value)
    assert "of shape (3, 5) here" in str(error.value)
    assert "same model and optimizer" in str(error.value)
    assert same(values(model.weights), before) and state.epoch == 0


def test_a_model_that_is_not_built_is_refused_saying_how_to_build_it():
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"not built.*model\.build\(input_shape\)"):
        hvd.elastic.KerasState(model)


def test_sync_keeps_rank_0s_values_and_saves_them():
    model = compiled_model()
    state = hvd.elastic.KerasState(model, batch=7)
    state.sync()
    weights = values(model.weights)
    train(model)
    state.batch = 8
    state.restore()
    assert same(values(model.weights), weights) and state.batch == 7


# ----------------------------------------------------------------------- the callbacks
class CountedState(hvd.elastic.KerasState):
    def commit(self) -> None:
        self.seen.append((self.epoch, self.batch))
        super().commit()


def test_callbacks_commit_every_n_batches_and_at_each_epochs_end():
    model = compiled_model()
    state = CountedState(model, epoch=0, batch=0, seen=[])
    callbacks = [
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=3),
    ]
    train(model, steps=4, callbacks=callbacks)  # 2 epochs of 2 batches
    # Horovod's counting: the count goes on across the epoch's end.
    assert state.seen == [(1, 0), (1, 0), (2, 0)]
    assert (state.epoch, state.batch) == (2, 0)


def test_a_fit_resumed_mid_epoch_trains_the_rest_of_that_epoch_then_whole_ones():
    model = compiled_model()
    state = hvd.elastic.KerasState(model, epoch=4, batch=3)  # as restored from a commit

    batches = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append((state.epoch, state.batch))

    callbacks = [
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        Record(),
    ]
    ones = (np.ones((8, 3), "float32"), np.ones((8, 2), "float32"))
    dataset = tf.data.Dataset.from_tensor_slices(ones).repeat().batch(2)
    history = model.fit(dataset, steps_per_epoch=5, epochs=2, callbacks=callbacks, verbose=0)
    # The committed batch 3 again, then 4 (Horovod's count); then a whole epoch of 5.
    assert batches == [(4, 3), (4, 4)] + [(5, b) for b in range(5)]
    assert (state.epoch, state.batch) == (6, 0) and len(history.history["loss"]) == 2
    assert not model.stop_training
    # fit(initial_epoch=state.epoch) counts on from the commit as well.
    model.fit(
        dataset,
        steps_per_epoch=5,
        initial_epoch=state.epoch,
        epochs=7,
        callbacks=callbacks,
        verbose=0,
    )
    assert state.epoch == 7


def test_batches_per_commit_below_one_is_refused():
    state = hvd.elastic.ObjectState(batch=0)
    with pytest.raises(ValueError, match="batches_per_commit must be 1 or more"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)


# -------------------------------------------------------------------- TensorFlowState
def test_tensorflow_state_follows_horovods_test_elastic_state():
    variables = [tf.Variable(np.full((2, 2), 1.0)), tf.Variable(np.full(2, 1.0))]
    other = [np.array([[1.0, 2.0], [3.0, 4.0]]), np.zeros(2)]
    state = hvd_tf.elastic.TensorFlowState(variables, batch=20, epoch=10)
    state.sync()
    for variable, value in zip(variables, other, strict=True):
        variable.assign(value)
    state.batch, state.epoch = 21, 11
    state.restore()  # back to the sync's values
    assert all(np.array_equal(v.numpy(), np.ones_like(v.numpy())) for v in variables)
    assert (state.batch, state.epoch) == (20, 10)
    for variable, value in zip(variables, other, strict=True):
        variable.assign(value)
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()  # the commit's
    assert same([v.numpy() for v in variables], other)
    assert (state.batch, state.epoch) == (21, 11)


def test_tensorflow_state_takes_keras_variables_and_refuses_other_shapes(monkeypatch):
    model = compiled_model(units=2)
    hvd_tf.elastic.TensorFlowState(model.trainable_variables, batch=5).commit()
    monkeypatch.setenv("RINGPLUG_RESTART", "1")
    again = hvd_tf.elastic.TensorFlowState(compiled_model(units=2, seed=1).trainable_variables)
    assert hvd_tf.elastic.run(lambda s: s.batch)(again) == 5
    assert same(values(again.variables), values(model.trainable_variables))
    monkeypatch.setattr(_elastic, "_resumed", False)
    fewer = hvd_tf.elastic.TensorFlowState([tf.Variable(np.zeros((3, 2), "float32"))])
    with pytest.raises(ValueError, match="holds 2 variables for it, and it has 1"):
        hvd_tf.elastic.run(lambda s: None)(fewer)


def test_tensorflow_state_refuses_tf1_sessions():
    with pytest.raises(NotImplementedError, match="eagerly"):
        hvd_tf.elastic.TensorFlowState([tf.Variable(1.0)], session=object())


def test_every_module_has_horovods_elastic_names():
    names = {
        "KerasState",
        "TensorFlowKerasState",
        "ObjectState",
        "run",
        "CommitStateCallback",
        "UpdateBatchStateCallback",
        "UpdateEpochStateCallback",
    }
    assert names <= set(dir(hvd.elastic))
    assert {"TensorFlowKerasState", "TensorFlowState", "ObjectState", "run"} <= set(
        dir(hvd_tf.elastic)
    )
    import ringplug.horovod.tensorflow.keras as hvd_tf_keras

    assert hvd_tf_keras.elastic is hvd.elastic and hvd_tf.keras.elastic is hvd.elastic


# ------------------------------------------------------------------------- real ranks
def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_killed_job(tmp_path: Path, style: str) -> tuple[list[dict], str]:
    """The style's worker on 3 ranks, rank 2 killed, restarted on 2; the starts of the
    restarted ranks (checked equal), and ringrun's output."""
    marker = unique_marker(f"hvd-elastic-{style}")
    result = run_ringrun(
        "-np",
        "3",
        "--min-np",
        "2",
        "--max-restarts",
        "2",
        "--host-discovery-script",
        str(discovery_script(tmp_path, "localhost:3", "localhost:2")),
        sys.executable,
        WORKER,
        style,
        str(tmp_path),
        marker,
        extra_env={
            "RINGPLUG_TIMEOUT": "30",
            "TMPDIR": str(tmp_path),
            "KERAS_BACKEND": "tensorflow",
            "TF_CPP_MIN_LOG_LEVEL": "3",
        },
        timeout=420,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert processes_matching(marker) == []
    assert "restart 1 of 2 after rank 2" in result.stderr
    starts = [json.loads((tmp_path / f"start.1.{r}").read_text()) for r in range(2)]
    assert starts[0] == starts[1], "the restarted ranks began from different states"
    first = json.loads((tmp_path / "start.0.0").read_text())
    assert starts[0]["job"] == first["job"] is not None
    assert (starts[0]["size"], starts[0]["lr"]) == (2, pytest.approx(0.002))  # reset callback
    resets = sorted(p.name for p in tmp_path.glob("reset.*"))
    assert resets == ["reset.1.0", "reset.1.1"]
    assert all((tmp_path / name).read_text() == "2\n" for name in resets)
    finals = {(tmp_path / f"final.1.{r}").read_text() for r in range(2)}
    assert len(finals) == 1  # identical weights on both ranks
    assert list(tmp_path.glob("final.0.*")) == []
    assert list(tmp_path.glob("ringplug-elastic-*")) == []  # ringrun removed the commits
    return starts, output


@pytest.mark.multirank
def test_a_keras_fit_with_horovods_callbacks_resumes_from_its_last_commit(tmp_path):
    starts, output = run_killed_job(tmp_path, "fit")
    # 3 ranks, 8 batches an epoch, a commit every 3 batches (the count going on across
    # epochs) and at each epoch's end: commits 1-2 at batches 2, 5; 3 at epoch 0's end; 4-5
    # at batches 0, 3 of epoch 1; rank 2 died after batch 4.
    assert "resumed from commit 5 (made by 3 ranks; 2 now)" in output
    committed = lines(tmp_path / "commits.0.0")
    assert [(c["epoch"], c["batch"]) for c in committed] == [(0, 2), (0, 5), (1, 0), (1, 0), (1, 3)]
    start = starts[0]
    assert (start["epoch"], start["batch"], start["commits"]) == (1, 3, 5)
    assert start["weights"] == committed[-1]["weights"]  # weights of the commit, synced
    assert start["steps"] == committed[-1]["steps"] == 13  # optimizer state restored too
    # On 2 ranks, 12 batches an epoch: epoch 1 finishes from the committed batch 3, epoch 2
    # is whole, and training ends with the 3 epochs done (commits 6-9 in epoch 1, 10-14 in 2).
    for rank in range(2):
        seen = [(b["epoch"], b["batch"]) for b in lines(tmp_path / f"batches.1.{rank}")]
        assert seen == [(1, b) for b in range(3, 12)] + [(2, b) for b in range(12)]
    last = lines(tmp_path / "commits.1.0")[-1]
    assert (last["epoch"], last["batch"], last["commit"]) == (3, 0, 14)


@pytest.mark.multirank
def test_a_gradient_tape_loop_resumes_from_its_last_commit(tmp_path):
    starts, output = run_killed_job(tmp_path, "tape")
    # A commit after every batch; rank 2 died before batch 6, so commit 6 (batch 5) is last.
    assert "resumed from commit 6 (made by 3 ranks; 2 now)" in output
    committed = lines(tmp_path / "commits.0.0")
    assert [c["batch"] for c in committed] == list(range(6))
    start = starts[0]
    assert (start["batch"], start["commits"]) == (5, 6)
    assert start["weights"] == committed[-1]["weights"]
    assert start["steps"] == committed[-1]["steps"] == 7  # the build step and 6 batches
    # Horovod's example: skip(state.batch).take(30 // size), counting on from the commit.
    for rank in range(2):
        assert [c["batch"] for c in lines(tmp_path / f"commits.1.{rank}")] == list(range(5, 20))
