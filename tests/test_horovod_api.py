"""Scripts written against Horovod's API (only ``hvd.*`` names) run on ringplug under
``ringrun -np N``: every collective swept over dtypes and shapes, the errors, join, an
MNIST-style torch training and a Keras training with Horovod's callbacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKERS = Path(__file__).parent / "workers"


# The scripts that share one job of N ranks, in turn (workers/in_turn.py): each framework
# is imported once per rank instead of once per script. Each writes PREFIX-RANK.json.
PREFIXES = {
    "hvd_collectives.py": "hvd",
    "hvd_adasum.py": "adasum",
    "hvd_tf_adasum.py": "tf_adasum",
    "hvd_semantics.py": "semantics",
    "hvd_mnist.py": "mnist",
    "hvd_resume.py": "resume",
    "hvd_keras.py": "keras",
    "hvd_tf.py": "tf",
    "hvd_tf_sets.py": "tf_sets",
    "hvd_tf1_hook.py": "hook",
}
# hvd_semantics.py joins and re-initialises: after the collectives. The TensorFlow scripts
# keep a job each: what hvd_keras.py leaves in a process (its automatic collective names
# differ between the ranks) makes the next script's ranks call collectives of other names.
JOBS = {
    ("torch", 2): [
        "hvd_collectives.py",
        "hvd_adasum.py",
        "hvd_semantics.py",
        "hvd_mnist.py",
        "hvd_resume.py",
    ],
    ("torch", 3): ["hvd_collectives.py", "hvd_adasum.py", "hvd_semantics.py", "hvd_resume.py"],
    # Adasum's tree two levels deep; process sets of two ranks each (hvd_semantics.py)
    ("torch", 4): ["hvd_adasum.py", "hvd_semantics.py"],
    ("keras", 2): ["hvd_keras.py"],
    ("tf", 2): ["hvd_tf.py", "hvd_tf_adasum.py", "hvd_tf_sets.py"],
    ("tf", 3): ["hvd_tf_sets.py"],  # a set of two ranks whose second is world rank 2
    ("tf1", 2): ["hvd_tf1_hook.py"],
}
TENSORFLOW = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
ENV = {"torch": {}, "keras": TENSORFLOW, "tf": {"TF_CPP_MIN_LOG_LEVEL": "3"}, "tf1": {}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(script, ranks)``: each rank's report of `script`, from the job of its framework
    and that many ranks (a failed job fails each of its tests with the job's output)."""
    jobs: dict[tuple[str, int], tuple[subprocess.CompletedProcess[str], Path]] = {}

    def reports(script: str, ranks: int = 2) -> list:
        key = next(key for key, scripts in JOBS.items() if key[1] == ranks and script in scripts)
        if key not in jobs:
            outdir = tmp_path_factory.mktemp(f"hvd-{key[0]}-{ranks}")
            in_turn = [a for s in JOBS[key] for a in ("+", s, str(outdir))][1:]
            result = run_ringrun(
                "-np",
                str(ranks),
                sys.executable,
                str(WORKERS / "in_turn.py"),
                *in_turn,
                extra_env={"RINGPLUG_TIMEOUT": "60", **ENV[key[0]]},
                timeout=420,
            )
            jobs[key] = (result, outdir)
        result, outdir = jobs[key]
        assert result.returncode == 0, result.stdout + result.stderr
        # Shown by pytest when a check of this report fails: what the ranks said.
        print(result.stderr[-20000:])
        prefix = PREFIXES[script]
        return [json.loads((outdir / f"{prefix}-{r}.json").read_text()) for r in range(ranks)]

    return reports


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_hvd_collective_matches_numpy_on_every_rank(run, ranks):
    reports = run("hvd_collectives.py", ranks)
    for checks in reports:
        # 7 dtypes x 5 shapes x 9 collectives and ops, plus the rest: none may go missing.
        assert len(checks) >= 338
        assert [name for name, ok in checks.items() if not ok] == []
    assert reports[0].keys() == reports[-1].keys()


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_horovod_semantics_where_they_differ_from_ringplug_torch(run, ranks):
    # Integer Average/scaling, alltoall forms and gradients, allgather's averaged gradient,
    # grouped collectives with autograd, join refusing allgather/broadcast, unnamed calls
    # in step after a mismatch, a join and a re-init, optimizer state and names, sparse,
    # and process sets (even and odd ranks: every collective, world root ranks, the
    # optimizer on one set, non-members refused, init(process_sets=...)).
    reports = run("hvd_semantics.py", ranks)
    for rank, checks in enumerate(reports):
        assert len(checks) >= (48 if rank else 46) + 31
        assert sum(name.startswith("ps-") for name in checks) == 31
        assert [name for name, ok in checks.items() if not ok] == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_adasum_matches_the_papers_pairwise_tree_on_a_power_of_two_ranks(run, ranks):
    # The core on numpy arrays and every hvd.allreduce form (float16/32/64), a fused burst
    # keeping each tensor's own norms, the sum/average limits, a zero vector, autograd,
    # results identical on every rank, mismatches naming the tensor, a joined rank, and
    # DistributedOptimizer(op=Adasum)'s delta step; against a numpy tree in the worker.
    reports = run("hvd_adasum.py", ranks)
    for checks in reports:
        assert len(checks) >= 56
        assert [name for name, ok in checks.items() if not ok] == []


def test_adasum_on_three_ranks_is_refused_on_every_rank_and_the_job_goes_on(run):
    reports = run("hvd_adasum.py", 3)
    for checks in reports:
        assert len(checks) == 6
        assert [name for name, ok in checks.items() if not ok] == []


def test_an_mnist_style_hvd_torch_script_trains_and_keeps_ranks_identical(run):
    for report in run("hvd_mnist.py"):
        assert report["ranks_identical"]  # broadcast + DistributedOptimizer (passes_per_step=2)
        assert report["accuracy"] > 0.9


@pytest.mark.parametrize("ranks", [2, 3])
def test_horovods_resume_recipe_with_weight_decay_keeps_every_rank_bitwise_identical(run, ranks):
    # Rank 0 loads the checkpoint, then broadcast_parameters and broadcast_optimizer_state:
    # the state-creating step on the other ranks moves no parameter (SGD with momentum and
    # weight decay, AdamW, Adam with maximize); check_agreement names one that moved.
    for checks in run("hvd_resume.py", ranks):
        assert len(checks) == 13
        assert [name for name, ok in checks.items() if not ok] == []


def test_a_horovod_keras_script_with_its_callbacks_runs_on_keras_3(run):
    pytest.importorskip("tensorflow")
    reports = run("hvd_keras.py")
    for report in reports:
        assert report["ranks_identical"]
        assert report["loss"][-1] < report["loss"][0]
        lr, rates, size = report["scaled_lr"], report["rates"], 2
        steps = len(rates) // 4
        # Horovod's warmup over 2 epochs: lr/size * (1 + (epoch + (batch+1)/steps)(size-1)/2),
        # then the schedule from epoch 2: lr * 0.1 ** (epoch - 2), set at each epoch's start.
        warmup = [
            lr / size * (1 + (e + (b + 1) / steps) * (size - 1) / 2)
            for e in range(2)
            for b in range(steps)
        ]
        assert rates == pytest.approx(warmup + [lr] * steps + [lr * 0.1] * steps)
        assert report["logged_lr"] == pytest.approx([lr * 3 / 4, lr, lr, lr * 0.1])
        assert report["config_round_trip"] and report["sparse_as_dense_identical"]
        # 2 ranks: 0 + 1, rank 1's value + 1; (-3 - 4) / 2 truncated toward zero, not floored.
        assert report["in_tf_function"] == [1.0, 2.0]
        assert report["integer_average"] == [-3, 7]


def test_horovod_tensorflow_eagerly_in_tf_function_and_in_a_graph_session(run):
    # Values and gradients of the collectives in all three modes, DistributedGradientTape
    # (IndexedSlices too), the partial tape and optimizer, local variables kept out of the
    # broadcast, load_model, 24 ops in one run; a mismatch is FailedPreconditionError
    # eagerly, in tf.function and in a session alike, with one message on every rank.
    pytest.importorskip("tensorflow")
    reports = run("hvd_tf.py")
    for checks in reports:
        assert len(checks) >= 32
        assert [name for name, ok in checks.items() if not ok] == []


def test_horovod_tensorflow_adasum_eagerly_in_tf_function_in_a_graph_and_in_the_tape(run):
    # Against a numpy tree in the worker; grouped tensors keep their own norms; IndexedSlices
    # and Keras optimizers refused as Horovod refuses them.
    pytest.importorskip("tensorflow")
    for checks in run("hvd_tf_adasum.py"):
        assert len(checks) >= 9
        assert [name for name, ok in checks.items() if not ok] == []


@pytest.mark.parametrize("ranks", [2, 3])
def test_horovod_tensorflow_process_sets_match_numpy_in_every_mode(run, ranks):
    # Even and odd ranks: every collective eagerly against numpy (world root ranks), inside
    # tf.function twice (gradients on the set), a TF1 session where only the members build
    # one op (the world op's name still agrees), DistributedGradientTape and the Keras
    # optimizer on one set (others keep their own gradients), size/included ops, and
    # non-members, roots outside the set, unregistered and removed sets refused.
    pytest.importorskip("tensorflow")
    reports = run("hvd_tf_sets.py", ranks)
    for checks in reports:
        assert len(checks) == 25
        assert all(name.startswith("tfps-") for name in checks)
        assert [name for name, ok in checks.items() if not ok] == []


def test_unsupported_horovod_features_say_so():
    hvd = pytest.importorskip("ringplug.horovod.torch")
    with pytest.raises(ValueError, match="must be a hvd.ProcessSet"):
        hvd.allreduce(__import__("torch").ones(1), process_set=object())
    with pytest.raises(NotImplementedError, match="communicator"):
        hvd.init(comm=[0, 1])


def test_broadcast_global_variables_hook_gives_tf1_sessions_roots_values(run):
    pytest.importorskip("tensorflow")
    reports = run("hvd_tf1_hook.py")
    # Each rank initialised its variable to rank+1 times [1, 2, 3]: all now hold rank 0's.
    assert [r["weights"] for r in reports] == [[1.0, 2.0, 3.0]] * 2
