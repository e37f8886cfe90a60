"""ringplug.tensorflow's own API under ``ringrun``: every collective (and its async form)
eagerly and inside ``tf.function``, against numpy on every rank; the gradient tape,
broadcast_variables, and a mismatch raising FailedPreconditionError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.multirank

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ranks: f"{ranks}ranks")
def job(request, tmp_path_factory) -> tuple[int, Path]:
    """One job of `ranks` ranks, two scripts (in_turn): tf_threads first, as it gives
    TensorFlow one inter-op thread before its first operation; tf_api then runs on that one
    thread too. Its ranks' check files are in the returned folder."""
    ranks, outdir = request.param, tmp_path_factory.mktemp("tf")
    result = run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        str(WORKERS / "in_turn.py"),
        "tf_threads.py",
        str(outdir),
        "+",
        "tf_api.py",
        str(outdir),
        extra_env={"RINGPLUG_TIMEOUT": "60", "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return ranks, outdir


def test_ringplug_tensorflow_collectives_tape_and_errors_match_numpy_on_every_rank(job):
    ranks, outdir = job
    for rank in range(ranks):
        checks = json.loads((outdir / f"rtf-{rank}.json").read_text())
        # 15 collectives x 2 modes, and the tape, broadcast, gradient and error checks.
        assert len(checks) >= 37
        assert [name for name, ok in checks.items() if not ok] == []


def test_more_concurrent_graph_collectives_than_inter_op_threads_complete(job):
    # tf_threads.py: a session.run of 14 collectives created in a different order on each
    # rank with one inter-op thread, twice, then a join; a mismatch in a session;
    # Horovod's TF1 training loop (an allreduce per gradient, MonitoredTrainingSession);
    # the same collectives in tf.function. A collective that held its thread while it
    # waited left each rank's thread in one the other rank had not reached, until
    # RINGPLUG_TIMEOUT.
    ranks, outdir = job
    expected = {
        "session-run-1",
        "session-run-2",
        "session-join",
        "session-mismatch",
        "session-in-step",
        "tf1-training",
        "function",
        "function-join",
    }
    for rank in range(ranks):
        checks = json.loads((outdir / f"threads-{rank}.json").read_text())
        assert set(checks) == expected
        assert [name for name, ok in checks.items() if not ok] == []


def test_import_does_no_work_and_init_leaves_tensorflows_thread_pool_alone():
    # Graph collectives hold no inter-op thread while they wait, so init() need not make
    # the pool larger (it did: 64 threads on any machine).
    code = (
        "import os; os.environ.pop('TF_NUM_INTEROP_THREADS', None)\n"
        "import ringplug.tensorflow as rtf\n"
        "from ringplug.tensorflow import _kernel\n"
        "before = os.environ.get('TF_NUM_INTEROP_THREADS')\n"
        "rtf.init()\n"
        "print(before, os.environ.get('TF_NUM_INTEROP_THREADS'), _kernel.available(), rtf.size())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-4:] == ["None", "None", "True", "1"]


def run_snippet(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    env.pop("TF_NUM_INTEROP_THREADS", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_horovods_keras_init_leaves_tensorflows_thread_pool_alone():
    # hvd.init() of the Keras skin on TensorFlow is ringplug.tensorflow.init: no thread
    # setting of its own (one rank here, so ringplug.keras splits no cores either).
    result = run_snippet(
        "import os, ringplug.horovod.tensorflow.keras as hvd\n"
        "hvd.init()\n"
        "import tensorflow as tf\n"
        "print(os.environ.get('TF_NUM_INTEROP_THREADS'),"
        " tf.config.threading.get_inter_op_parallelism_threads())\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["None", "0"]


def test_init_after_tensorflows_first_operation_warns_only_where_collectives_block():
    # With the asynchronous op the pool's size does not matter: no warning. Where it cannot
    # be registered (here: pretended), a collective blocks a thread while it waits (a
    # numpy_function), and an init() too late to enlarge the pool says what to do.
    result = run_snippet(
        "import os, warnings, tensorflow as tf\n"
        "tf.constant(1.0) + 1.0\n"
        "import ringplug.tensorflow as rtf\n"
        "from ringplug.tensorflow import _kernel\n"
        "for blocking in (False, True):\n"
        "    if blocking:\n"
        "        _kernel.available = lambda: False\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        rtf.init()\n"
        "    print(blocking, [str(w.message) for w in caught])\n"
        "print(tf.function(lambda: rtf.allreduce(tf.ones([2]), op='sum'))().numpy())\n"
    )
    assert result.returncode == 0, result.stderr
    # ... and the blocking op still reduces (one rank here).
    *_, asynchronous, blocking, reduced = result.stdout.splitlines()
    assert reduced == "[1. 1.]"
    assert asynchronous == "False []"
    assert "before the first TensorFlow operation" in blocking
    assert "TF_NUM_INTEROP_THREADS" in blocking
