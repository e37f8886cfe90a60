"""DistributedBucketSampler on real ranks: aligned samples through DataLoader workers, equal
batch counts (no hang) on data that does not divide, Lightning inside and outside the
hooks, and the exact normalization for token-budget batches."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "data_sampler.py")
COUNT = 101


# What each job of N ranks runs, one scenario after the other in the same ranks (torch and
# Lightning are imported once per rank); a scenario whose framework is missing is left out.
JOBS = {2: ["loader", "normalize", "lightning-outside", "lightning-hook"], 3: ["loader"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(scenario, ranks)``: each rank's report of that scenario, from the job of that
    many ranks (a failed job fails each of its tests with the job's output)."""
    jobs: dict[int, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def reports(scenario: str, ranks: int = 2) -> list[dict]:
        if ranks not in jobs:
            outdir = tmp_path_factory.mktemp(f"sampler-{ranks}")
            lightning = importlib.util.find_spec("lightning") is not None
            scenarios = [s for s in JOBS[ranks] if lightning or not s.startswith("lightning")]
            result = run_ringrun(
                "-np",
                str(ranks),
                sys.executable,
                WORKER,
                ",".join(scenarios),
                str(outdir),
                extra_env={"RINGPLUG_TIMEOUT": "60"},
                timeout=300,
            )
            jobs[ranks] = (result, outdir)
        result, outdir = jobs[ranks]
        assert result.returncode == 0, result.stdout + result.stderr
        return [json.loads((outdir / f"{scenario}-{r}.json").read_text()) for r in range(ranks)]

    return reports


@pytest.mark.parametrize("ranks", [2, 3])
def test_workers_deliver_aligned_samples_and_every_rank_the_same_batch_count(run, ranks):
    reports = run("loader", ranks)
    for epoch in range(2):
        walks = [report["epochs"][epoch] for report in reports]
        assert all(walk["aligned"] for walk in walks)  # every target still matches its input
        assert len({walk["batches"] for walk in walks}) == 1
        ids = [i for walk in walks for i in walk["ids"]]
        # Every sample once, plus the reported repeats that equalize the batch counts.
        assert set(ids) == set(range(COUNT))
        assert len(ids) - COUNT == reports[0]["repeated"]
    assert reports[0]["epochs"][0]["ids"] != reports[0]["epochs"][1]["ids"]  # reshuffled


@pytest.mark.parametrize("where", ["outside", "hook"])
def test_lightning_keeps_the_sampler_wherever_the_loader_was_made(run, where):
    pytest.importorskip("lightning")
    reports = run(f"lightning-{where}")
    assert [r["kept"] for r in reports] == ["DistributedBucketSampler"] * 2
    assert reports[0]["batches"] == reports[1]["batches"] > 0
    first, second = reports[0]["ids"], reports[1]["ids"]
    assert set(first) | set(second) == set(range(COUNT))
    # Shards are disjoint but for the few samples repeated to equalize the counts.
    assert len(set(first) & set(second)) <= len(first) + len(second) - COUNT


def test_global_mean_scale_makes_uneven_batches_train_like_one_process(run):
    reports = run("normalize")
    for report in reports:
        assert report["matches_one_process"], report["max_difference"]
    # The ranks really held different sample counts in some steps.
    assert any(a != b for a, b in zip(reports[0]["counts"], reports[1]["counts"], strict=True))
