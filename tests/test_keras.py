"""ringplug.keras on 2 real ranks, TensorFlow and torch backends: training equals one
process on the union of the batches, and the callbacks keep the ranks together."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("keras")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "keras_fit.py")
SCENARIOS = [
    "plain",
    "clipnorm",
    "accumulate",
    "mixed",
    "warmup",
    "warmup_resume",
    "early_stopping",
    "save_load",
    "late_build",
    "undistributed",
    "statistics",
    "drift",
]
BACKENDS = {
    "tensorflow": [*SCENARIOS, "steps_per_execution", "xla", "bucketed"],
    "torch": SCENARIOS,  # Keras's torch backend has no steps_per_execution
    "jax": [*SCENARIOS, "steps_per_execution"],
}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def run(request, tmp_path_factory) -> dict:
    backend = request.param
    pytest.importorskip(backend)
    outdir = tmp_path_factory.mktemp(f"keras-{backend}")
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        WORKER,
        str(outdir),
        *BACKENDS[backend],
        extra_env={
            "KERAS_BACKEND": backend,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            # a rank left waiting in a reduction fails the test instead of hanging it
            "RINGPLUG_TIMEOUT": "60",
        },
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads((outdir / f"keras-{r}.json").read_text()) for r in range(2)]
    assert [r["backend"] for r in reports] == [backend, backend]
    return {"reports": reports, "outdir": outdir, "backend": backend}


@pytest.mark.parametrize("scenario", ["plain", "clipnorm", "accumulate", "steps_per_execution"])
def test_two_ranks_train_like_one_process_on_the_union_of_their_batches(run, scenario):
    if scenario not in run["reports"][0]:
        pytest.skip(f"{scenario} does not exist on the {run['backend']} backend")
    for report in run["reports"]:
        found = report[scenario]
        # Each rank started from other random weights: equal to the reference (which starts
        # from rank 0's) only if RingBroadcast made them rank 0's.
        assert found["matches_one_process"], found["max_difference"]
        assert found["ranks_identical"] and found["moved_from_start"]


def test_xla_is_turned_off_for_training_with_a_warning_on_tensorflow(run):
    if "xla" not in run["reports"][0]:
        pytest.skip("jit_compile only needs turning off on TensorFlow")
    for report in run["reports"]:
        xla = report["xla"]
        assert xla["matches_one_process"] and xla["ranks_identical"]
        assert any("jit_compile=False" in w for w in xla["warnings"])


def test_accumulation_reduces_once_per_update(run):
    for report in run["reports"]:
        plain, accumulated = report["plain"], report["accumulate"]
        assert accumulated["optimizer_steps"] == plain["optimizer_steps"] // 2
        # 12 batches: 12 reductions without accumulation, 6 with; the broadcast is the same.
        assert plain["collectives"] - accumulated["collectives"] == 6


def test_a_model_that_builds_on_its_first_batch_is_broadcast_after_it(run):
    assert all(report["late_build"]["ranks_identical"] for report in run["reports"])


def test_mixed_precision_with_inf_gradients_on_one_rank_keeps_ranks_together(run):
    for report in run["reports"]:
        mixed = report["mixed"]
        assert mixed["loss_scale_optimizer"] == "LossScaleOptimizer"
        assert mixed["ranks_identical"] and mixed["finite"]
        # Rank 1's overflow made both ranks skip that step and halve the scale once.
        assert mixed["scales"] == [2.0**14, 2.0**14]


def test_warmup_follows_the_linear_scaling_formula_with_momentum_correction(run):
    for report in run["reports"]:
        warmup = report["warmup"]
        steps, size, target = warmup["steps_per_epoch"], 2, 0.2
        # fit(initial_epoch=1, epochs=3) with warmup_epochs=2: epoch 1 still warms up, on
        # Horovod's curve: at batch b of epoch e, target/N * (1 + (e + (b+1)/steps)(N-1)/W).
        expected = [
            target / size * (1 + (1 + (b + 1) / steps) * (size - 1) / 2) for b in range(steps)
        ] + [target] * steps
        assert warmup["lrs"] == pytest.approx(expected, rel=1e-6)
        rows = zip(
            warmup["lrs_before"],
            warmup["lrs"],
            warmup["slots_before"],
            warmup["slots_after"],
            strict=True,
        )
        for before_lr, lr, before, after in rows:
            # The momentum slots were rescaled by new LR / old LR whenever the LR changed.
            assert after == pytest.approx(before * lr / before_lr, rel=1e-5)
        changed = [a != b for a, b in zip(warmup["lrs"], warmup["lrs_before"], strict=True)]
        assert sum(changed) >= steps - 1


def test_warmup_resumed_mid_way_goes_on_to_the_original_target_on_every_rank(run):
    for report in run["reports"]:
        resumed = report["warmup_resume"]
        steps, size, target, warmup = resumed["steps_per_epoch"], 2, 0.3, 3
        # Epochs 1 and 2 of a 3-epoch warmup towards 0.3 (not towards the saved, part-warmed
        # LR, nor rank 1's own 0.7), then the end of the warmup.
        expected = [
            target / size * (1 + (e + (b + 1) / steps) * (size - 1) / warmup)
            for e in (1, 2)
            for b in range(steps)
        ]
        assert resumed["lrs"] == pytest.approx(expected, rel=1e-6)
        assert resumed["lrs"][-1] == pytest.approx(target, rel=1e-6)
        assert resumed["ranks_identical"]


def test_metric_average_makes_early_stopping_stop_every_rank_together(run):
    runs = [report["early_stopping"] for report in run["reports"]]
    # Alone, rank 0 (falling val_loss) would run all 8 epochs; averaged, both stop at 2.
    assert [r["epochs_run"] for r in runs] == [2, 2]
    assert runs[0]["val_loss"] == runs[1]["val_loss"] == pytest.approx([1.0, 1.2])
    written = sorted(p.name for p in (run["outdir"] / "checkpoints").iterdir())
    assert written == ["epoch1-rank0.weights.h5", "epoch2-rank0.weights.h5"]


def test_a_saved_model_loads_with_the_plain_optimizer(run):
    for report in run["reports"]:
        loaded = report["save_load"]
        assert loaded["plain"] and loaded["same_weights"]
        assert loaded["class"].rsplit(".", 1)[-1] == "SGD" and loaded["momentum"] == 0.5


def test_an_undistributed_optimizer_is_warned_about(run):
    for report in run["reports"]:
        assert any(
            "not a ringplug.keras.DistributedOptimizer" in w
            for w in report["undistributed"]["warnings"]
        )


def test_ranks_that_drift_apart_stop_fit_on_every_rank_naming_the_first_weight(run):
    # Every other scenario trains with RingBroadcast's check at each epoch's end, unraised.
    for report in run["reports"]:
        for every, where in (("epoch", "at the end of epoch 0"), ("2", "at step 2")):
            found = report["drift"][every]
            assert found["raised"] and found["groups"] == [[0], [1]]
            assert found["tensor"].endswith("kernel")
            assert f"disagree {where} on '{found['tensor']}'" in found["message"]
            assert "rank 0 holds value A; rank 1 holds value B" in found["message"]


def test_bucketed_tf_data_keeps_samples_aligned_and_batch_counts_equal(run):
    if "bucketed" not in run["reports"][0]:
        pytest.skip("the tf.data pipeline is tested on the TensorFlow backend")
    reports = [report["bucketed"] for report in run["reports"]]
    assert all(r["aligned"] and r["identical"] and r["fit_epochs"] == 2 for r in reports)
    for epoch in range(2):
        walks = [r["epochs"][epoch] for r in reports]
        assert walks[0]["batches"] == walks[1]["batches"]
        ids = walks[0]["ids"] + walks[1]["ids"]
        assert set(ids) == set(range(101))  # every sample, plus a few repeats at most
    assert reports[0]["epochs"][0]["ids"] != reports[0]["epochs"][1]["ids"]  # next epoch's order


def test_ring_broadcast_gives_every_rank_roots_batchnorm_statistics(run):
    for report in run["reports"]:
        # Each rank's batches moved its own statistics (the test can tell them apart) ...
        assert not report["statistics"]["unsynced"]
        # ... and RingBroadcast handed root's to every rank at the end of training.
        assert report["statistics"]["synced"]
