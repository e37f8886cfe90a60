"""Every collective x dtype x size on real ranks, against a numpy reference.

Each configuration forces a different data path (MPI's own Allreduce or ringplug's ring,
with small ring segments so that the segment loop runs), so each path is checked on 2 and
3 ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from collectives import expected_case_names  # noqa: E402

pytestmark = pytest.mark.multirank

WORKERS = Path(__file__).parent / "workers"

PATHS = {
    "default": {},
    "ring-only": {
        "RINGPLUG_EAGER_THRESHOLD": "0",
        "RINGPLUG_RING_THRESHOLD": "0",
        "RINGPLUG_RING_SEGMENT": "4K",
    },  # fmt: skip
    "mpi-allreduce": {"RINGPLUG_EAGER_THRESHOLD": "0", "RINGPLUG_RING_THRESHOLD": "1G"},
}


def run_worker(tmp_path: Path, ranks: int, env: dict[str, str]) -> list[dict]:
    result = run_ringrun(
        "-np", str(ranks), sys.executable, str(WORKERS / "collectives.py"), str(tmp_path),
        extra_env=env, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_collective_matches_numpy_on_every_rank(tmp_path, ranks, path):
    reports = run_worker(tmp_path, ranks, PATHS[path])
    expected = set(expected_case_names(ranks))
    for report in reports:
        assert report["size"] == ranks
        assert set(report["cases"]) == expected
        failed = {name: case for name, case in report["cases"].items() if not case["ok"]}
        assert not failed, f"rank {report['rank']} failed: {json.dumps(failed, indent=1)[:4000]}"


@pytest.mark.parametrize(("path", "expected"), [("default", "ring"), ("mpi-allreduce", "mpi")])
def test_the_threshold_picks_the_data_path(tmp_path, path, expected):
    (report, _) = run_worker(tmp_path, 2, PATHS[path])
    assert report["path_12M"] == expected
