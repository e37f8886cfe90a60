"""torch.distributed groups, stores and monitored barriers under ringplug, on real ranks.

Lightning calls ``dist.new_group(backend="gloo")`` around every ``prepare_data``; libraries
meet through the group's store; ``new_group(ranks=...)``, ``new_subgroups`` and a
``DeviceMesh``'s dimensions run on the core's process sets. Each must work on the
``ringplug`` backend, whichever way torch.distributed was started, or fail by a deadline
naming what is missing. One job per world size (3 and 4 ranks) runs the shared scenarios.
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
SHARED = ["calls:backend", "calls:strategy", "sets:backend", "monitored-missing:strategy"]
# Rank 2 of the group [1, 2] stops calling: stall settings small, in a job of its own; then
# rank 2 never makes a members-only group with ranks 0 and 1, who give up after the timeout.
FROZEN_SETTINGS = {
    "RINGPLUG_STALL_CHECK_SECONDS": "1",
    "RINGPLUG_STALL_SHUTDOWN_SECONDS": "4",
    "RINGPLUG_TIMEOUT": "15",
}


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
def frozen_job(tmp_path_factory):
    """The job of 3 ranks with small stall settings: ``frozen``, then ``missing``."""
    outdir = tmp_path_factory.mktemp("frozen")
    return job(outdir, 3, "frozen:backend", "missing:backend", **FROZEN_SETTINGS), outdir


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
@pytest.mark.parametrize("ranks", [3, 4])
def test_groups_stores_and_barriers_work_on_every_rank(run, ranks, start):
    reports = run("calls", start, ranks)
    members = reports[0]["checks"]
    assert "world-gloo/served-by-ringplug" in members
    assert "subgroup-gloo/all_reduce" in members and "store/wait-has-a-deadline" in members
    # rank 1 is outside the groups [0, last]
    assert reports[1]["checks"]["subgroup-default/non-member"]
    assert "subgroup-default/all_reduce" not in reports[1]["checks"]


KINDS = [
    "all_reduce-sum",
    "all_reduce-avg",
    "all_reduce-max",
    "broadcast-root-not-group-rank-0",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all_single-uneven",
    "barrier-lets-none-through-early",
]
ROOTED = ["reduce-at-the-root", "gather-at-the-root"]


@pytest.mark.parametrize("ranks", [3, 4])
def test_every_collective_kind_on_subgroups_matches_numpy(run, ranks):
    reports = run("sets", "backend", ranks)
    last = ranks - 1
    groups = {"upper": list(range(1, ranks)), "pair": [0, last]}
    for rank, report in enumerate(reports):
        for key, members in groups.items():
            if rank not in members:
                assert report["checks"][f"{key}/non-member"], rank
                assert report["checks"][f"{key}/outside-untouched"], rank
                continue
            ran = {f"{key}/{kind}" for kind in KINDS + ["on-ringplug", "rank-and-size"]}
            if rank == members[-1]:  # the roots
                ran |= {f"{key}/{kind}" for kind in ROOTED}
            assert ran <= set(report["checks"]), sorted(ran - set(report["checks"]))


@pytest.mark.parametrize("ranks", [3, 4])
def test_overlapping_groups_and_the_world_run_at_once(run, ranks):
    reports = run("sets", "backend", ranks)
    # The last rank is in both groups and started them in the other order.
    assert {"in-flight-at-once/pair", "in-flight-at-once/upper", "in-flight-at-once/world"} <= set(
        reports[-1]["checks"]
    )


@pytest.mark.parametrize("ranks", [3, 4])
def test_removal_p2p_and_bad_groups_are_refused_alike(run, ranks):
    reports = run("sets", "backend", ranks)
    for rank in (0, ranks - 1):  # the pair's members
        checks = reports[rank]["checks"]
        assert checks["pair/destroy-refused-while-pending"], reports[rank]["details"]
        assert checks["pair/send-refused"] and checks["pair/destroyed-set-removed"]
    for report in reports:
        assert report["checks"]["bad/ranks-disagree"] and report["checks"]["bad/sort_ranks-false"]
        assert report["checks"]["no-gloo-group"], report["details"]["group-kinds"]


@pytest.mark.parametrize("ranks", [3, 4])
def test_local_sync_groups_made_at_once_by_disjoint_ranks_run_every_kind(run, ranks):
    reports = run("sets", "backend", ranks)
    last = ranks - 1
    local = {"P": [0, last], "Q": list(range(1, last))}
    for rank, report in enumerate(reports):
        key = "P" if rank in local["P"] else "Q"
        want = {f"local-{key}/{kind}" for kind in KINDS + ["on-ringplug", "rank-and-size"]}
        want |= {f"local-{key}/named-by-its-members", f"local-{key}/destroyed-among-members"}
        want |= {"local/other-group-is-none-here", "local/every-rank"}
        assert want <= set(report["checks"]), sorted(want - set(report["checks"]))
        if rank == local[key][-1]:
            assert f"local-{key}/reduce-at-the-root" in report["checks"]
    for rank in local["P"]:
        checks = reports[rank]["checks"]
        assert checks["local-bad/duplicate-ranks"] and checks["local-bad/sort_ranks-false"]


@pytest.mark.parametrize("ranks", [3, 4])
def test_new_subgroups_run_on_sets(run, ranks):
    for report in run("sets", "backend", ranks):
        assert report["checks"]["new_subgroups/all_reduce"]
        assert report["checks"]["new_subgroups/on-ringplug"]


def test_a_device_mesh_of_2_by_2_runs_its_dimensions_and_dtensor_on_sets(run):
    for report in run("sets", "backend", 4):
        names = {n for n in report["checks"] if n.startswith(("mesh/", "dtensor/"))}
        assert {"mesh/dp/on-ringplug", "mesh/tp/all_gather", "dtensor/redistribute-shard-1"} <= (
            names
        )


@pytest.mark.parametrize("ranks", [3, 4])
def test_a_monitored_barrier_names_the_rank_that_did_not_arrive_and_the_job_goes_on(run, ranks):
    reports = run("monitored-missing", "strategy", ranks)
    assert reports[0]["checks"]["monitored/raised"]  # rank 0 waited for rank 1
    assert reports[1]["checks"]["monitored/raised"]  # rank 1 came after rank 0 gave up


def test_a_frozen_member_of_a_group_is_named_by_world_rank_and_set(frozen_job):
    result, tmp_path = frozen_job
    assert result.returncode == 0, result.stdout + result.stderr
    reports = checked(tmp_path, "frozen", "backend", 3)
    checks = reports[1]["checks"]
    assert checks["frozen/monitored_barrier-names-rank-and-set"], reports[1]["details"]
    assert checks["frozen/stall-error-names-rank-and-set"], reports[1]["details"]
    assert reports[2]["checks"]["frozen/group-shut-down-here-too"]
    assert all(report["checks"]["frozen/job-goes-on"] for report in reports)
    # The set's first member (world rank 1) reported the stall while it lasted.
    assert (
        "Stalled collectives: 'torch.g" in result.stdout + result.stderr
        and "is ready on rank(s) 1 but not on rank(s) 2" in result.stdout + result.stderr
    )


def test_a_member_that_never_makes_a_local_sync_group_is_named_on_those_that_did(frozen_job):
    result, tmp_path = frozen_job
    assert result.returncode == 0, result.stdout + result.stderr
    reports = checked(tmp_path, "missing", "backend", 3)
    for rank in (0, 1):
        checks = reports[rank]["checks"]
        assert checks["missing/names-rank-and-set"], reports[rank]["details"]
        assert checks["missing/after-its-timeout"] and checks["missing/is-a-timeout"]
    assert all(report["checks"]["missing/job-goes-on"] for report in reports)


def test_a_member_that_makes_a_local_sync_group_after_the_others_gave_up_is_told_who_gave_up(
    frozen_job,
):
    result, tmp_path = frozen_job
    assert result.returncode == 0, result.stdout + result.stderr
    late = checked(tmp_path, "missing", "backend", 3)[2]
    assert late["checks"]["missing/late-member-refused"], late["details"]
    assert late["checks"]["missing/every-member-tries-again-and-makes-it"]


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


SUBGROUP_PROGRAM = """
import json, sys
import torch, torch.distributed as dist
import ringplug.torch
dist.init_process_group("ringplug")
rank = dist.get_rank()
group = dist.new_group([0, 2])
value = torch.full((3,), float(rank + 1))
if rank in (0, 2):
    dist.all_reduce(value, group=group)
    root = torch.full((2,), float(rank))
    dist.broadcast(root, src=2, group=group)
    report = {"sum": value.tolist(), "root": root.tolist(), "backend": dist.get_backend(group)}
else:
    report = {"member": dist.get_rank(group)}
if rank != 1:  # only the members call, with use_local_synchronization
    local = dist.new_group([0, 2], use_local_synchronization=True)
    mine = torch.full((2,), float(rank + 1))
    dist.all_reduce(mine, group=local)
    report["local"] = mine.tolist()
    dist.destroy_process_group(local)
dist.barrier()
print("REPORT", rank, json.dumps(report), flush=True)
dist.destroy_process_group()
"""


def test_a_group_over_some_ranks_works_on_the_oldest_torch_too():
    # torch 2.13 hands new_group to the default group (a process set, made by its members
    # only with use_local_synchronization); torch 2.4 asks the backend's constructor on the
    # members only (a gloo group inside ringplug's). In `make test-oldest` too.
    result = run_ringrun("-np", "3", sys.executable, "-c", SUBGROUP_PROGRAM, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = {}
    for line in result.stdout.splitlines():
        if "REPORT" in line:
            _, rank, text = line.split("REPORT", 1)[1].split(" ", 2)
            reports[int(rank)] = json.loads(text)
    assert reports[1] == {"member": -1}  # torch's answer for a rank outside the group
    for rank in (0, 2):
        assert reports[rank] == {
            "sum": [4.0] * 3,
            "root": [2.0] * 2,
            "backend": "ringplug",
            "local": [4.0] * 2,
        }
