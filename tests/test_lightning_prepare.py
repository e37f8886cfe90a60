"""Lightning's ``prepare_data`` under RingStrategy, on real ranks.

Lightning wraps every ``prepare_data`` in a barrier of a new gloo group
(``_InfiniteBarrier``); under ringplug that group is served by the engine, so the ranks that
do not prepare the data wait for the one that does, and any way that rank fails ends the
job naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("lightning")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "lightning_prepare.py")
IN_TURN = str(Path(__file__).parent / "workers" / "in_turn.py")


def job(scenario: str, tmp_path: Path, ranks: int = 2, timeout: float = 180, **env: str):
    return run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        WORKER,
        scenario,
        str(tmp_path),
        extra_env=env,
        timeout=timeout,
    )


def prepared(tmp_path: Path) -> list[str]:
    ledger = tmp_path / "prepared.txt"
    return ledger.read_text().splitlines() if ledger.exists() else []


def reports(scenario: str, tmp_path: Path, ranks: int) -> list[dict]:
    return [json.loads((tmp_path / f"{scenario}-{r}.json").read_text()) for r in range(ranks)]


# The runs that pass share a job per number of ranks: the worker runs once per scenario, one
# after the other in the same ranks (workers/in_turn.py), each in a folder of its own, so
# Lightning is imported once per rank.
SHARED = {2: ["per-node", "module"], 3: ["once", "fabric"]}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``shared(scenario, ranks)``: the folder of that scenario's run in the shared job,
    once the job has passed (a failed job fails each of its tests with the job's output)."""
    jobs: dict[int, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def folder(scenario: str, ranks: int) -> Path:
        if ranks not in jobs:
            outdir = tmp_path_factory.mktemp(f"prepare-{ranks}")
            arguments = []
            for name in SHARED[ranks]:
                (outdir / name).mkdir()
                arguments += ["+", "lightning_prepare.py", name, str(outdir / name)]
            result = run_ringrun(
                "-np", str(ranks), sys.executable, IN_TURN, *arguments[1:], timeout=300
            )
            jobs[ranks] = (result, outdir)
        result, outdir = jobs[ranks]
        assert result.returncode == 0, result.stdout + result.stderr
        return outdir / scenario

    return folder


# 2 and 3 ranks among them; on one host, per node is once.
@pytest.mark.parametrize(("scenario", "ranks"), [("per-node", 2), ("once", 3), ("module", 2)])
def test_prepare_data_runs_once_per_node_and_every_rank_fits(shared, scenario, ranks):
    outdir = shared(scenario, ranks)
    # One host: local rank 0 is global rank 0, with either prepare_data_per_node.
    assert prepared(outdir) == ["0 0"]
    trained = reports(scenario, outdir, ranks)
    assert [r["rank"] for r in trained] == list(range(ranks))
    assert len({r["weights"] for r in trained}) == 1  # every rank ends with rank 0's model


def test_a_prepare_data_longer_than_ringplug_timeout_is_waited_for_and_reported(tmp_path):
    result = job("slow", tmp_path, RINGPLUG_TIMEOUT="3", RINGPLUG_STALL_CHECK_SECONDS="2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # The stall report says where the missing rank is instead of calling it lost.
    assert "rank 0 was in prepare_data for" in output, output
    assert len({r["weights"] for r in reports("slow", tmp_path, 2)}) == 1


def test_a_prepare_data_that_raises_ends_the_job_at_once_naming_its_rank(tmp_path):
    # RINGPLUG_TIMEOUT is long: the job must not end by a timeout.
    result = job("fails", tmp_path, ranks=3, timeout=120, RINGPLUG_TIMEOUT="600")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "the download of the data set failed" in output
    assert "ringrun: rank 0" in output, output
    assert not list(tmp_path.glob("fails-*.json"))


def test_a_prepare_data_that_never_returns_ends_the_job_by_the_barrier_timeout(tmp_path):
    result = job("hangs", tmp_path, timeout=120, RINGPLUG_BARRIER_TIMEOUT="4")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "BarrierTimeoutError" in output
    assert (
        "(its timeout: 4 s) for rank(s) 0, which never called it; rank 0 was in "
        "prepare_data" in output
    ), output
    assert "ringrun: rank 0 stopped taking part in the job (named by rank 1)" in output, output


def test_fabric_rank_zero_first_lets_rank_zero_through_first(shared):
    ranks = 3
    lines = prepared(shared("fabric", ranks))
    assert lines[0] == "0 0" and sorted(lines) == sorted(f"{r} {r}" for r in range(ranks))
