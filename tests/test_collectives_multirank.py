"""Every collective x dtype x size on real ranks, against a numpy reference.

Each configuration forces a different data path (MPI's own Allreduce or ringplug's ring,
with small ring segments so that the segment loop runs), so each path is checked on 2 and
3 ranks.
"""

from __future__ import annotations

import json
import subprocess
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
    },
    "mpi-allreduce": {"RINGPLUG_EAGER_THRESHOLD": "0", "RINGPLUG_RING_THRESHOLD": "1G"},
}


@pytest.fixture(scope="module")
def run_worker(tmp_path_factory):
    """``run_worker(ranks, path)``: each rank's report of the job on that data path, run
    once for every test that reads it (the sweep and the path each ask for it)."""
    jobs: dict[tuple[int, str], tuple[subprocess.CompletedProcess[str], Path]] = {}

    def reports(ranks: int, path: str) -> list[dict]:
        if (ranks, path) not in jobs:
            outdir = tmp_path_factory.mktemp(f"collectives-{path}-{ranks}")
            result = run_ringrun(
                "-np",
                str(ranks),
                sys.executable,
                str(WORKERS / "collectives.py"),
                str(outdir),
                extra_env=PATHS[path],
                timeout=240,
            )
            jobs[ranks, path] = (result, outdir)
        result, outdir = jobs[ranks, path]
        assert result.returncode == 0, result.stdout + result.stderr
        return [json.loads((outdir / f"report-{r}.json").read_text()) for r in range(ranks)]

    return reports


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_collective_matches_numpy_on_every_rank(run_worker, ranks, path):
    reports = run_worker(ranks, path)
    expected = set(expected_case_names(ranks))
    for report in reports:
        assert report["size"] == ranks
        assert set(report["cases"]) == expected
        failed = {name: case for name, case in report["cases"].items() if not case["ok"]}
        assert not failed, f"rank {report['rank']} failed: {json.dumps(failed, indent=1)[:4000]}"


@pytest.mark.parametrize(("path", "expected"), [("default", "ring"), ("mpi-allreduce", "mpi")])
def test_the_threshold_picks_the_data_path(run_worker, path, expected):
    (report, _) = run_worker(2, path)
    assert report["path_12M"] == expected
