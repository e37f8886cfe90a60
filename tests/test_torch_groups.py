"""torch.distributed groups, stores and monitored barriers under ringplug, on real ranks.

Lightning calls ``dist.new_group(backend="gloo")`` around every ``prepare_data``; libraries
meet through the group's store. Each must work on the ``ringplug`` backend, whichever way
torch.distributed was started, or fail by a deadline naming what is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "torch_groups.py")


# The scenarios that share a job of N ranks, one after the other (torch is imported once per
# rank); the one left waiting in a monitored barrier goes last.
SHARED = ["calls:backend", "calls:strategy", "monitored-missing:strategy"]


def checked(outdir: Path, scenario: str, start: str, ranks: int) -> list[dict]:
    """Each rank's report of `scenario` under `start`, with every one of its checks passed."""
    reports = [
        json.loads((outdir / f"{scenario}-{start}-{r}.json").read_text()) for r in range(ranks)
    ]
    for report in reports:
        assert [name for name, ok in report["checks"].items() if not ok] == [], report
    return reports


def job(outdir: Path, ranks: int, *runs: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_ringrun(
        "-np", str(ranks), sys.executable, WORKER, str(outdir), *runs, extra_env=env, timeout=240
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(scenario, start, ranks)``: each rank's checked report, from the shared job of
    that many ranks (a failed job fails every test with its output)."""
    jobs: dict[int, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def reports(scenario: str, start: str, ranks: int) -> list[dict]:
        assert f"{scenario}:{start}" in SHARED
        if ranks not in jobs:
            outdir = tmp_path_factory.mktemp(f"groups-{ranks}")
            jobs[ranks] = (job(outdir, ranks, *SHARED), outdir)
        result, outdir = jobs[ranks]
        assert result.returncode == 0, result.stdout + result.stderr
        return checked(outdir, scenario, start, ranks)

    return reports


@pytest.mark.parametrize("start", ["backend", "strategy"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_groups_stores_and_barriers_work_on_every_rank(run, ranks, start):
    reports = run("calls", start, ranks)
    members = reports[0]["checks"]
    assert "world-gloo/served-by-ringplug" in members
    assert "subgroup-gloo/all_reduce" in members and "store/wait-has-a-deadline" in members
    if ranks == 3:  # rank 1 is outside the groups [0, 2]
        assert reports[1]["checks"]["subgroup-default/non-member"]
        assert "subgroup-default/all_reduce" not in reports[1]["checks"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_monitored_barrier_names_the_rank_that_did_not_arrive_and_the_job_goes_on(run, ranks):
    reports = run("monitored-missing", "strategy", ranks)
    assert reports[0]["checks"]["monitored/raised"]  # rank 0 waited for rank 1
    assert reports[1]["checks"]["monitored/raised"]  # rank 1 came after rank 0 gave up


def test_a_subgroup_collective_a_member_never_joins_fails_by_the_deadline(tmp_path):
    result = job(tmp_path, 3, "subgroup-missing:backend", RINGPLUG_TIMEOUT="10")
    assert result.returncode == 0, result.stdout + result.stderr
    reports = checked(tmp_path, "subgroup-missing", "backend", 3)
    assert reports[0]["checks"]["subgroup/raised"], reports[0]["details"]


def test_a_store_the_ranks_cannot_reach_says_why_when_used_and_nothing_else_breaks():
    # rank 0 with no address the other hosts route to (or a rank that cannot connect): the
    # job still trains, and only a use of the store fails, at once and saying why.
    code = (
        "import torch, torch.distributed as dist\n"
        "import ringplug.torch\n"
        "from ringplug.torch.process_group import UnreachableStore\n"
        "store = UnreachableStore('rank 0 has no address the other hosts can reach')\n"
        "dist.init_process_group('ringplug', store=store, rank=0, world_size=1)\n"
        "tensor = torch.ones(2)\n"
        "dist.all_reduce(tensor)\n"
        "print('all_reduce', tensor.tolist())\n"
        "try:\n"
        "    dist.distributed_c10d._get_default_store().wait(['key'])\n"
        "except RuntimeError as exc:\n"
        "    print('refused', type(exc).__name__, exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "all_reduce [1.0, 1.0]" in result.stdout
    assert (
        "refused RingplugError torch.distributed's store is not available on rank 0: rank 0 "
        "has no address the other hosts can reach"
    ) in result.stdout
