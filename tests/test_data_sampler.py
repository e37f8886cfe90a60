"""DistributedBucketSampler on real ranks: aligned samples through DataLoader workers, equal
batch counts (no hang) on data that does not divide, Lightning inside and outside the
hooks, and the exact normalization for token-budget batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "data_sampler.py")
COUNT = 101


def run(scenario: str, tmp_path: Path, ranks: int = 2) -> list[dict]:
    result = run_ringrun("-np", str(ranks), sys.executable, WORKER, scenario, str(tmp_path),
                         extra_env={"RINGPLUG_TIMEOUT": "60"}, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads((tmp_path / f"{scenario}-{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3])
def test_workers_deliver_aligned_samples_and_every_rank_the_same_batch_count(tmp_path, ranks):
    reports = run("loader", tmp_path, ranks)
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
def test_lightning_keeps_the_sampler_wherever_the_loader_was_made(tmp_path, where):
    pytest.importorskip("lightning")
    reports = run(f"lightning-{where}", tmp_path)
    assert [r["kept"] for r in reports] == ["DistributedBucketSampler"] * 2
    assert reports[0]["batches"] == reports[1]["batches"] > 0
    first, second = reports[0]["ids"], reports[1]["ids"]
    assert set(first) | set(second) == set(range(COUNT))
    # Shards are disjoint but for the few samples repeated to equalize the counts.
    assert len(set(first) & set(second)) <= len(first) + len(second) - COUNT


def test_global_mean_scale_makes_uneven_batches_train_like_one_process(tmp_path):
    reports = run("normalize", tmp_path)
    for report in reports:
        assert report["matches_one_process"], report["max_difference"]
    # The ranks really held different sample counts in some steps.
    assert any(a != b for a, b in zip(reports[0]["counts"], reports[1]["counts"], strict=True))
