"""Sharded optimizer state on real ranks: DistributedOptimizer(zero=1/2) trains as zero=0 does.

One job per world size runs every scenario (workers/torch_zero.py); the 3-rank job runs
first and leaves a checkpoint that the 2-rank job resumes from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKERS = Path(__file__).parent / "workers"
CASES = [
    *(f"{name}-plain-zero{zero}" for name in ("sgd", "adam", "adamw") for zero in (1, 2)),
    *(f"adamw-clip-zero{zero}" for zero in (1, 2)),
    *(f"adam-accumulate-zero{zero}" for zero in (1, 2)),
    *(f"adam-tiny-zero{zero}" for zero in (1, 2)),
    *(f"sgd-wide-zero{zero}" for zero in (1, 2)),
    # zero_layout="flat"
    *(f"adam-plain-zero{zero}-flat" for zero in (1, 2)),
    "sgd-plain-zero2-flat",
    "adamw-clip-zero2-flat",
    "adam-accumulate-zero2-flat",
    "adam-tiny-zero2-flat",
    "sgd-wide-zero2-flat",
]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """``job(ranks)``: (folder, each rank's report) of the job of that many ranks, once it
    has passed; the 2-rank job resumes from the 3-rank job's checkpoint."""
    jobs: dict[int, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def run(ranks: int) -> tuple[Path, list[dict]]:
        if ranks not in jobs:
            outdir = tmp_path_factory.mktemp(f"zero-{ranks}")
            extra = [str(run(3)[0] / "resume.pt")] if ranks == 2 else []
            result = run_ringrun(
                "-np", str(ranks), sys.executable, str(WORKERS / "torch_zero.py"), str(outdir),
                *extra, timeout=300,
            )  # fmt: skip
            jobs[ranks] = (result, outdir)
        result, outdir = jobs[ranks]
        assert result.returncode == 0, result.stdout + result.stderr
        reports = [json.loads((outdir / f"zero-{r}.json").read_text()) for r in range(ranks)]
        return outdir, reports

    return run


@pytest.mark.parametrize("ranks", [3, 2])
@pytest.mark.parametrize("case", CASES)
def test_sharded_training_ends_where_unsharded_training_does(job, case, ranks):
    for report in job(ranks)[1]:
        result = report[case]
        assert result["relative_difference"] <= 1e-6, result
        assert result["ranks_identical"]
        if "-clip-" in case:  # the bound was small enough to clip, in both runs
            assert result["clipped"] and result["unsharded_clipped"]


@pytest.mark.parametrize("ranks", [3, 2])
@pytest.mark.parametrize("case", [c for c in CASES if "-tiny-" not in c])
def test_each_rank_holds_its_share_of_the_optimizer_state(job, case, ranks):
    for report in job(ranks)[1]:
        result = report[case]
        assert 0 < result["state_bytes"] <= result["unsharded_state_bytes"] / ranks * 1.05
        if "zero2" in case:  # and of the averaged gradients
            assert 0 < result["grad_bytes"] <= result["unsharded_grad_bytes"] / ranks * 1.05
        else:
            assert result["grad_bytes"] == result["unsharded_grad_bytes"]


@pytest.mark.parametrize("ranks", [3, 2])
@pytest.mark.parametrize("case", [c for c in CASES if "zero2" in c])
def test_stage_2_gradients_keep_no_memory_beyond_their_own(job, case, ranks):
    # Not views into a reduce-scatter buffer of the whole bucket, which would keep all of it.
    for report in job(ranks)[1]:
        assert report[case]["grad_storage_bytes"] == report[case]["grad_bytes"]


@pytest.mark.parametrize("ranks", [3, 2])
def test_in_place_collectives_reduce_and_gather_blocks_of_any_length(job, ranks):
    both = {"reducescatter": True, "allgather": True}
    for report in job(ranks)[1]:
        assert report["in_place"] == {"small": both, "ring": both}


@pytest.mark.parametrize("ranks", [3, 2])
def test_fewer_parameters_than_ranks_leaves_shards_empty_and_still_trains(job, ranks):
    reports = job(ranks)[1]
    held = [report["adam-tiny-zero2"]["state_bytes"] for report in reports]
    assert sorted(held)[:-1] == [0] * (ranks - 1) and held[0] > 0


@pytest.mark.parametrize("ranks", [3, 2])
def test_consolidated_state_dict_loads_into_a_plain_optimizer(job, ranks):
    outdir, reports = job(ranks)
    assert all(report["sharded_round_trip"] for report in reports)
    saved = torch.load(outdir / f"consolidated-{ranks}.pt")
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        *(m for _ in range(6) for m in (torch.nn.Tanh(), torch.nn.Linear(32, 32))),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )
    model.load_state_dict(saved["model"])
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    plain.load_state_dict(saved["optimizer"])
    reference = saved["unsharded"]["state"]
    assert sorted(plain.state_dict()["state"]) == sorted(reference)
    for index, state in plain.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(state[key], reference[index][key], rtol=1e-6, atol=1e-9)
    model(torch.zeros(1, 8)).sum().backward()
    plain.step()  # and it goes on


@pytest.mark.parametrize("ranks", [3, 2])
def test_flat_layout_state_consolidates_to_the_unsharded_state_and_loads_back(job, ranks):
    for report in job(ranks)[1]:
        assert report["flat_state"] == {
            "consolidated_equals_unsharded": True,
            "loads_whole_state": True,
            "sharded_round_trip": True,
            "whole_layout_refuses_flat_shard": True,
        }


def test_a_run_saved_on_3_ranks_resumes_on_2(job):
    for report in job(2)[1]:
        assert report["resumed"]["relative_difference"] <= 1e-6, report["resumed"]
        assert report["resumed"]["ranks_identical"]


@pytest.mark.parametrize("ranks", [3, 2])
def test_lbfgs_is_refused_with_what_to_use_instead(job, ranks):
    for report in job(ranks)[1]:
        assert "LBFGS cannot be sharded" in report["lbfgs_refused"]
        assert "zero=0" in report["lbfgs_refused"]


@pytest.mark.parametrize("ranks", [3, 2])
def test_broadcasting_a_sharded_optimizers_state_is_refused_on_every_rank(job, ranks):
    for report in job(ranks)[1]:
        for label in ("core", "horovod"):
            said = report[f"broadcast_refused_{label}"]
            assert said is not None and "sharded optimizer" in said
            assert "load_state_dict" in said


@pytest.mark.parametrize("ranks", [3, 2])
def test_torch_zero_redundancy_optimizer_trains_on_the_ringplug_backend(job, ranks):
    for report in job(ranks)[1]:
        result = report["torch_zero_redundancy"]
        assert result["relative_difference"] <= 1e-6, result
        assert result["ranks_identical"] and result["consolidated_loads"]
