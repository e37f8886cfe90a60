"""torch.distributed on the ``ringplug`` backend, on real ranks started by ringrun."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun, torchrun_workers_refused

pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "torch_backend.py")


def checked(outdir: Path, scenario: str, ranks: int) -> list[dict]:
    """Each rank's report of `scenario`, with every one of its checks passed."""
    reports = [json.loads((outdir / f"{scenario}-{r}.json").read_text()) for r in range(ranks)]
    for report in reports:
        assert [name for name, ok in report["checks"].items() if not ok] == [], report
    return reports


def run(scenario: str, ranks: int, outdir: Path, **kwargs) -> list[dict]:
    result = run_ringrun(
        "-np", str(ranks), sys.executable, WORKER, scenario, str(outdir), timeout=180, **kwargs
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return checked(outdir, scenario, ranks)


# The 2-rank scenarios that share one job, one after the other (torch is imported once per
# rank); "ddp" keeps jobs of its own: its timeline must hold DDP's allreduces alone.
SHARED = ["calls", "torchmetrics", "lightning-ddp"]
# What a shared scenario needs beyond torch: without it the job leaves the scenario out.
OPTIONAL = {"torchmetrics": "torchmetrics", "lightning-ddp": "lightning"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``shared(scenario)``: each rank's checked report from the shared 2-rank job (a failed
    job fails each of its tests with the job's output)."""
    jobs: dict[str, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def reports(scenario: str) -> list[dict]:
        if not jobs:
            outdir = tmp_path_factory.mktemp("backend-shared")
            scenarios = [s for s in SHARED if importlib.util.find_spec(OPTIONAL.get(s, "torch"))]
            result = run_ringrun(
                "-np", "2", sys.executable, WORKER, ",".join(scenarios), str(outdir), timeout=300
            )
            jobs["job"] = (result, outdir)
        result, outdir = jobs["job"]
        assert result.returncode == 0, result.stdout + result.stderr
        return checked(outdir, scenario, 2)

    return reports


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_torch_distributed_call_gives_the_reference_on_every_rank(shared, tmp_path, ranks):
    reports = shared("calls") if ranks == 2 else run("calls", ranks, tmp_path)
    assert len(reports[0]["checks"]) == 62 + 2 * ranks  # broadcast and reduce from each root
    assert all(r["checks"].keys() == reports[0]["checks"].keys() for r in reports)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_on_the_backend_equals_one_process_with_the_whole_batch(tmp_path, ranks):
    timeline = tmp_path / "timeline.json"
    reports = run("ddp", ranks, tmp_path, extra_env={"RINGPLUG_TIMELINE": str(timeline)})
    assert set(reports[0]["checks"]) == {"ddp/equals-one-process", "ddp/ranks-bitwise-identical"}
    # DDP's bucket allreduces went through the engine: the timeline shows them on one row.
    events = json.loads(timeline.read_text())
    rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    calls = [e for e in events if e["name"] == "ALLREDUCE" and rows[e["tid"]] == "torch.default"]
    assert len(calls) >= 8  # at least one per step
    assert all(e["args"]["call"].startswith("torch.default#") for e in calls)


def test_torchmetrics_syncs_over_the_backend(shared):
    pytest.importorskip("torchmetrics")
    reports = shared("torchmetrics")
    assert set(reports[0]["checks"]) == {"torchmetrics/mean", "torchmetrics/accuracy"}


def test_lightning_ddp_strategy_on_the_backend_equals_one_process(shared):
    pytest.importorskip("lightning")
    reports = shared("lightning-ddp")
    assert set(reports[0]["checks"]) == {
        "lightning-ddp/backend",
        "lightning-ddp/equals-one-process",
        "lightning-ddp/ranks-bitwise-identical",
    }


def test_a_torch_collective_that_one_rank_never_reaches_is_reported_and_ends_the_job(tmp_path):
    # Over gloo this hung silently; on the ringplug backend the engine watches it.
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        WORKER,
        "stall",
        str(tmp_path),
        timeout=90,
        extra_env={"RINGPLUG_TIMEOUT": "6", "RINGPLUG_STALL_CHECK_SECONDS": "2"},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "'torch.default#1' is ready on rank(s) 0 but not on rank(s) 1" in output, output
    assert "in allreduce 'torch.default#1' for rank(s) 1, which never submitted it" in output


def test_under_torchrun_the_backend_says_to_start_the_job_with_an_mpi_launcher(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this interpreter")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", WORKER, "calls", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert torchrun_workers_refused(output, 2), output  # each worker, or stopped by torchrun
    assert "Start the job with `ringrun -np 2 python ...`" in output
    assert list(tmp_path.glob("*.json")) == []  # no rank trained alone
