"""A Keras fit under ringrun that loses a rank, or is preempted, resumes mid-epoch.

Real jobs (tests/workers/keras_elastic.py): ``fit(callbacks=[RingBroadcast(0),
keras.callbacks.BackupAndRestore(dir, save_freq=K)])`` over a ``bucketed_dataset``, no
resume code of the user's. Each rank's ledger of the samples its train steps saw shows that
the resumed epoch trains each sample not yet trained once, on the ranks left. The rest runs
in this process (one rank): the restore, its checks and its errors.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from launch import discovery_script, processes_matching, run_ringrun, unique_marker
from test_elastic import ids_of, ledger, report, restart_lines
from test_elastic import preempt as elastic_preempt

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

import ringplug.keras as rk  # noqa: E402
from ringplug.data import plan_batches  # noqa: E402

WORKER = str(Path(__file__).parent / "workers" / "keras_elastic.py")
LENGTHS = [1 + (i * 7) % 13 for i in range(72)]  # the worker's, for its plans


def environment(backend: str) -> dict[str, str]:
    # RINGPLUG_TIMEOUT: a rank left waiting fails the test instead of hanging it.
    return {"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3", "RINGPLUG_TIMEOUT": "20"}


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_a_fit_that_loses_a_rank_resumes_mid_epoch_on_the_ranks_left(tmp_path, backend):
    pytest.importorskip(backend)
    # 72 samples, batches of 4: 6 per rank and epoch on 3 ranks, 9 on 2. A backup every 2
    # steps; rank 2 of 3 dies with 9 steps done (epoch 1, batch 2), so the backup is of step 8.
    script = discovery_script(tmp_path, "localhost:3", "localhost:2")
    marker = unique_marker("keras-kill")
    result = run_ringrun(
        "-np",
        "3",
        "--max-restarts",
        "2",
        "--min-np",
        "2",
        "--host-discovery-script",
        str(script),
        sys.executable,
        WORKER,
        "kill",
        str(tmp_path),
        "0",
        marker,
        extra_env=environment(backend),
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert processes_matching(marker) == [], "ranks were left running"
    assert result.returncode == 0, output
    (line,) = restart_lines(result.stderr)
    assert "killed by signal SIGKILL: 2 ranks on localhost:2 (was 3)" in line
    assert sorted(p.name for p in tmp_path.glob("done.*")) == ["done.1.0.json", "done.1.1.json"]
    assert "epoch 1, after 2 of its batches, step 8 (written by 3 ranks, 2 now)" in output

    first = [ledger(tmp_path, 0, rank) for rank in range(3)]
    again = [ledger(tmp_path, 1, rank) for rank in range(2)]
    assert first[2][-1]["step"] == 9  # the victim's last step; the others' may be 8 or 9
    assert {walk[-1]["step"] for walk in first[:2]} <= {8, 9}
    saved = 8
    # The restart goes on from the backup: the step, the epoch, the weights (rank 0's).
    began = [report(tmp_path, 1, rank)["began"] for rank in range(2)]
    at_save = next(r for r in first[0] if r["step"] == saved)
    assert [b["step"] for b in began] == [saved, saved]
    assert began[0]["weights"] == began[1]["weights"] == at_save["weights"]
    assert [(walk[0]["step"], walk[0]["epoch"]) for walk in again] == [(saved + 1, 1)] * 2

    # The killed epoch: what the backup had trained plus what the restart trained is every
    # sample once; only the samples of the steps after the backup were trained twice.
    before = [r for walk in first for r in walk if r["epoch"] == 1 and r["step"] <= saved]
    lost = [r for walk in first for r in walk if r["epoch"] == 1 and r["step"] > saved]
    after = [r for walk in again for r in walk if r["epoch"] == 1]
    assert ids_of(before + after) == Counter(range(72))
    twice = {i for i, n in ids_of(before + lost + after).items() if n == 2}
    assert twice == set(ids_of(lost)) and len(twice) >= 4
    # 48 samples left for 2 ranks: 6 batches each, then the epoch ends (not 9: no fillers).
    assert [len([r for r in walk if r["epoch"] == 1]) for walk in again] == [6, 6]
    # Epoch 0 (3 ranks), and epoch 2 whole on 2 ranks, in epoch 2's own order.
    assert ids_of([r for walk in first for r in walk if r["epoch"] == 0]) == Counter(range(72))
    for rank, walk in enumerate(again):
        plan = plan_batches(LENGTHS, batch_size=4, num_replicas=2, rank=rank, seed=3, epoch=2)
        assert [r["ids"] for r in walk if r["epoch"] == 2] == plan.batches

    reports = [report(tmp_path, 1, rank) for rank in range(2)]
    assert [r["steps"] for r in reports] == [6 + 2 + 6 + 9] * 2
    assert reports[0]["weights"] == reports[1]["weights"]
    assert [r["world"] for r in reports] == [2, 2]
    assert not reports[0]["backup_left"]  # delete_checkpoint=True: gone once the fit ended


def preempt(folder: Path, ranks: int) -> tuple[int, str]:
    """The sigterm job, SIGTERMed once every rank waits after step 3: ringrun's exit code
    and output."""
    return elastic_preempt(
        WORKER,
        folder,
        ranks,
        "keras-sigterm",
        env={**os.environ, **environment("tensorflow")},
        wait_s=180,
    )


@pytest.mark.multirank
def test_sigterm_saves_a_backup_where_every_rank_stopped_and_a_new_fit_resumes_there(tmp_path):
    pytest.importorskip("tensorflow")
    returncode, output = preempt(tmp_path, ranks=2)
    assert returncode == 128 + signal.SIGTERM, output
    first = [ledger(tmp_path, 0, rank) for rank in range(2)]
    stopped = first[0][-1]["step"]
    assert first[1][-1]["step"] == stopped  # every rank stopped after the same batch
    assert 3 < stopped < 12  # it trained on after the signal, to the agreed batch
    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    place = metadata["ringplug"]
    assert (metadata["epoch"], place["batches_done"], place["steps"]) == (0, stopped, stopped)
    assert (place["data"]["epoch"], place["data"]["batches"]) == (0, stopped)
    assert f"SIGTERM stopped training at step {stopped}" in output

    marker = unique_marker("keras-sigterm-again")
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        WORKER,
        "sigterm",
        str(tmp_path),
        "1",
        marker,
        extra_env=environment("tensorflow"),
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    again = [ledger(tmp_path, 1, rank) for rank in range(2)]
    assert [walk[0]["step"] for walk in again] == [stopped + 1] * 2
    trained = [r for walk in first + again for r in walk]
    assert ids_of(trained) == Counter(range(96))  # each sample of the epoch once
    reports = [report(tmp_path, 1, rank) for rank in range(2)]
    assert [r["steps"] for r in reports] == [12, 12]
    assert reports[0]["weights"] == reports[1]["weights"]
    assert reports[0]["began"]["weights"] == first[0][-1]["weights"]


# ---------------------------------------------------------------------------- one rank


@pytest.fixture(autouse=True)
def world_of_one(request):
    if request.node.get_closest_marker("multirank") is None:
        import ringplug

        ringplug.init()  # this process alone: rank 0 of 1


def numbered(count: int, seed: int = 3):
    """A bucketed_dataset of samples (x_i, y_i) whose x holds i, and the ids it yields."""
    import tensorflow as tf

    yielded: list[list[int]] = []

    def collate(samples: list[tuple]) -> tuple:
        yielded.append([int(s[0][0]) for s in samples])
        return np.stack([s[0] for s in samples]), np.stack([s[1] for s in samples])

    def load(i: int) -> tuple:
        return np.array([i, 1.0], np.float32), np.array([0.5 * (i % 3)], np.float32)

    signature = (tf.TensorSpec((None, 2), tf.float32), tf.TensorSpec((None, 1), tf.float32))
    lengths = [1 + i % 5 for i in range(count)]
    dataset = rk.bucketed_dataset(
        load, lengths, signature, batch_size=4, collate=collate, seed=seed
    )
    return dataset, yielded, lengths


def model_of(units: int = 1) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(units)])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.5), loss="mse")
    return model


class StopAt(keras.callbacks.Callback):
    """Raises after the train step that makes the optimizer's step count `step`."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None) -> None:
        if int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) == self.step:
            raise KeyboardInterrupt("stopped by the test")


def stopped_fit(folder: Path, stop: int, epochs: int = 2, callback=None) -> keras.Model:
    dataset, _, _ = numbered(24)
    model = model_of()
    backup = callback or rk.BackupAndRestore(str(folder), save_freq=2)
    with pytest.raises(KeyboardInterrupt):
        model.fit(dataset, epochs=epochs, verbose=0, callbacks=[backup, StopAt(stop)])
    return model


def test_a_resumed_fit_trains_only_the_rest_of_the_epoch_in_its_order(tmp_path):
    # 24 samples in batches of 4: 6 steps an epoch. Stopped after step 9 (epoch 1, batch 2);
    # the backup is of step 8, epoch 1 after 2 batches.
    stopped_fit(tmp_path, stop=9)
    dataset, yielded, lengths = numbered(24)
    model = model_of()
    history = model.fit(
        dataset, epochs=3, verbose=0, callbacks=[rk.BackupAndRestore(str(tmp_path), save_freq=2)]
    )
    assert len(history.history["loss"]) == 2  # epochs 1 (resumed) and 2
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 8 + 4 + 6
    plan = [plan_batches(lengths, batch_size=4, seed=3, epoch=e).batches for e in (1, 2)]
    # Epoch 1: its samples not in the backup's 2 batches, each once, in 4 batches (then
    # fillers, yielded ahead but never trained); then all of epoch 2, in its order.
    done = {i for batch in plan[0][:2] for i in batch}
    resumed = yielded[:4]
    assert sorted(i for batch in resumed for i in batch) == sorted(set(range(24)) - done)
    rest = yielded[4:]
    while rest and rest[0] in resumed:
        rest = rest[1:]
    assert rest[:6] == plan[1]
    assert not tmp_path.exists()  # delete_checkpoint


def test_the_keras_callback_beside_ring_broadcast_becomes_ringplugs(tmp_path):
    stock = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=2)
    stopped_fit(tmp_path, stop=3, callback=stock)
    assert type(stock) is keras.callbacks.BackupAndRestore  # alone: Keras's own
    folder = tmp_path / "beside"
    stock = keras.callbacks.BackupAndRestore(str(folder), save_freq=2)
    dataset, _, _ = numbered(24)
    model = model_of()
    with pytest.raises(KeyboardInterrupt):
        model.fit(dataset, epochs=2, verbose=0, callbacks=[rk.RingBroadcast(0), stock, StopAt(5)])
    assert type(stock) is rk.BackupAndRestore
    metadata = json.loads((folder / "training_metadata.json").read_text())
    assert metadata["epoch"] == 0 and metadata["ringplug"]["batches_done"] == 4
    # Renamed into place: no temporary files, and no previous pair once the new one is in.
    assert sorted(os.listdir(folder)) == ["latest.weights.h5", "training_metadata.json"]


def test_a_backup_written_by_another_model_is_refused_and_says_what_to_do(tmp_path):
    stopped_fit(tmp_path, stop=3)
    dataset, _, _ = numbered(24)
    other = model_of(units=3)
    with pytest.raises(ValueError, match="written by another model") as caught:
        other.fit(dataset, epochs=1, verbose=0, callbacks=[rk.BackupAndRestore(str(tmp_path))])
    message = str(caught.value)
    assert (
        "weight 0 ('sequential" in message and "shape (2, 1) in the backup, (2, 3) here" in message
    )
    assert "give this run its own backup_dir" in message


def test_damaged_metadata_is_an_error_that_names_the_file_and_what_to_do(tmp_path):
    stopped_fit(tmp_path, stop=3)
    (tmp_path / "training_metadata.json").write_text('{"epoch": 0, "batch"')  # cut short
    dataset, _, _ = numbered(24)
    with pytest.raises(ValueError, match="cannot be restored") as caught:
        model_of().fit(dataset, epochs=1, verbose=0, callbacks=[rk.BackupAndRestore(str(tmp_path))])
    message = str(caught.value)
    assert "training_metadata.json is not JSON" in message
    assert "delete the folder to start training afresh" in message


def test_a_save_cut_short_between_its_renames_restores_the_previous_pair(tmp_path):
    # Rank 0 killed after the new weights were renamed into place but before the metadata:
    # the weights are of a later step than the metadata, whose pair is the .bkp weights.
    backup = rk.BackupAndRestore(str(tmp_path), save_freq=2, double_checkpoint=True)
    stopped_fit(tmp_path, stop=5, callback=backup)
    newer = model_of()
    dataset, _, _ = numbered(24)
    newer.fit(dataset, epochs=1, verbose=0)  # 6 steps
    os.replace(tmp_path / "training_metadata.json.bkp", tmp_path / "training_metadata.json")
    newer.save_weights(str(tmp_path / "latest.weights.h5"))  # step 6; the metadata is of 2
    assert json.loads((tmp_path / "training_metadata.json").read_text())["ringplug"]["steps"] == 2
    model = model_of()
    callback = rk.BackupAndRestore(str(tmp_path))
    callback.set_model(model)
    assert callback.restore()
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2
    assert model._initial_epoch == 0


def test_arrays_resumed_mid_epoch_warn_that_the_epoch_is_trained_again(tmp_path):
    x = np.arange(48, dtype=np.float32).reshape(24, 2)
    y = np.zeros((24, 1), np.float32)
    model = model_of()
    with pytest.raises(KeyboardInterrupt):
        backup = rk.BackupAndRestore(str(tmp_path), save_freq=2)
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[backup, StopAt(9)])
    model = model_of()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backup = rk.BackupAndRestore(str(tmp_path), save_freq=2)
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[backup])
    text = "\n".join(str(w.message) for w in caught)
    assert "epoch 1 after 2 of its batches" in text
    assert "trained again from its start" in text and "bucketed_dataset" in text
    assert len(history.history["loss"]) == 1  # epoch 1, whole: nothing skipped
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 8 + 6


def test_bucketed_dataset_takes_the_fits_epoch_not_its_own_pass_count():
    # Before, a fit started at epoch 2 got epoch 0's order (each pass counted epochs).
    dataset, yielded, lengths = numbered(24, seed=4)
    model = model_of()
    model.fit(dataset, epochs=3, initial_epoch=2, verbose=0, callbacks=[rk.RingBroadcast(0)])
    assert yielded[:6] == plan_batches(lengths, batch_size=4, seed=4, epoch=2).batches
