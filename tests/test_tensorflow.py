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

WORKER = Path(__file__).parent / "workers" / "tf_api.py"


@pytest.mark.parametrize("ranks", [2, 3])
def test_ringplug_tensorflow_collectives_tape_and_errors_match_numpy_on_every_rank(tmp_path, ranks):
    result = run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        str(WORKER),
        str(tmp_path),
        extra_env={"RINGPLUG_TIMEOUT": "60", "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(ranks):
        checks = json.loads((tmp_path / f"rtf-{rank}.json").read_text())
        # 15 collectives x 2 modes, and the tape, broadcast, gradient and error checks.
        assert len(checks) >= 37
        assert [name for name, ok in checks.items() if not ok] == []


def test_import_does_no_work_and_init_sets_the_graph_thread_pool():
    code = (
        "import os; os.environ.pop('TF_NUM_INTEROP_THREADS', None)\n"
        "import ringplug.tensorflow as rtf\n"
        "before = os.environ.get('TF_NUM_INTEROP_THREADS')\n"
        "rtf.init()\n"
        "print(before, int(os.environ['TF_NUM_INTEROP_THREADS']) >= 64, rtf.size())\n"
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
    assert result.stdout.split()[-3:] == ["None", "True", "1"]


def run_snippet(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    env.pop("TF_NUM_INTEROP_THREADS", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_horovods_keras_init_makes_room_for_a_graphs_concurrent_collectives():
    # hvd.init() of the Keras skin on TensorFlow: the thread pool of ringplug.tensorflow.init
    # (before it, a Keras script followed by a TF1 session.run of many collectives in one
    # process waited until RINGPLUG_TIMEOUT).
    result = run_snippet(
        "import os, ringplug.horovod.tensorflow.keras as hvd\n"
        "hvd.init()\n"
        "import tensorflow as tf\n"
        "print(os.environ.get('TF_NUM_INTEROP_THREADS'),"
        " tf.config.threading.get_inter_op_parallelism_threads())\n"
    )
    assert result.returncode == 0, result.stderr
    threads, pool = map(int, result.stdout.split()[-2:])
    assert threads >= 64 and pool == threads


def test_init_after_tensorflows_first_operation_warns_what_to_do():
    result = run_snippet(
        "import warnings, tensorflow as tf\n"
        "tf.constant(1.0) + 1.0\n"
        "import ringplug.tensorflow as rtf\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    rtf.init()\n"
        "print([str(w.message) for w in caught])\n"
    )
    assert result.returncode == 0, result.stderr
    assert "before the first TensorFlow operation" in result.stdout
    assert "TF_NUM_INTEROP_THREADS" in result.stdout
