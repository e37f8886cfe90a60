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
