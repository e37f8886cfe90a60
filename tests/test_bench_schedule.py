"""How `ringplug-bench` times competitors side by side, in a world of one."""

from __future__ import annotations

import itertools

import pytest

import ringplug
from ringplug.bench.common import measure_side_by_side


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    ringplug.init()
    yield


def test_implementations_take_turns_in_rounds_and_each_gets_its_iterations():
    calls: list[str] = []
    runs = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = measure_side_by_side(
        runs, budget_s=0.0, min_iters=20, max_iters=20, warmup=1, rounds=10
    )
    assert calls[:3] == ["a", "b", "c"]  # the warm-up, one call each
    timed = calls[3:]
    assert {name: len(t) for name, t in times.items()} == {"a": 20, "b": 20, "c": 20}
    assert all(value >= 0.0 for t in times.values() for value in t)
    # Ten rounds of two timed calls each after an untimed one, the first implementation of
    # a round rotating.
    blocks = [(name, len(list(group))) for name, group in itertools.groupby(timed)]
    assert blocks[:6] == [("a", 3), ("b", 3), ("c", 3), ("b", 3), ("c", 3), ("a", 3)]
    assert len(blocks) == 30 and all(count == 3 for _, count in blocks)


def test_fewer_iterations_than_rounds_still_spread_over_the_run():
    calls: list[str] = []
    runs = {name: (lambda name=name: calls.append(name)) for name in ("fast", "slow")}
    times = measure_side_by_side(runs, budget_s=0.0, min_iters=3, max_iters=3, warmup=0)
    assert [len(t) for t in times.values()] == [3, 3]
    # A share (an untimed call, then a timed one) each in rounds 4, 7 and 10 (counting from
    # 1), whose order the rotation flips: not all of one and then all of the other.
    shares = [calls[i : i + 2] for i in range(0, len(calls), 2)]
    assert all(share[0] == share[1] for share in shares)
    assert [share[0] for share in shares] == ["slow", "fast", "fast", "slow", "slow", "fast"]


def test_training_jobs_run_in_pairs_whose_order_flips_and_ratios_keep_their_sides():
    from ringplug.bench.common import alternating_pairs

    jobs: list[tuple[str, int]] = []
    speed = {"ours": 300.0, "theirs": 100.0, "alone": 50.0}

    def job(impl: str, ranks: int) -> dict:
        jobs.append((impl, ranks))
        return {
            "samples_per_s": speed[impl] * ranks,
            "seconds": 1.0,
            "steps_timed": 4,
            "ranks": ranks,
            "parameters": 10,
        }

    comparisons = [("2 ranks", "ours", "theirs", 2), ("1 rank", "ours", "alone", 1)]
    records, ratios = alternating_pairs(3, comparisons, job, lambda impl, r: f"{impl}@{r}")
    first = [("ours", 2), ("theirs", 2), ("ours", 1), ("alone", 1)]
    flipped = [("theirs", 2), ("ours", 2), ("alone", 1), ("ours", 1)]
    assert jobs == first + flipped + first
    # first / second of each comparison, whichever ran first in the pair
    assert ratios == {"2 ranks": [3.0, 3.0, 3.0], "1 rank": [6.0, 6.0, 6.0]}
    assert [record.impl for record in records][:4] == ["ours@2", "theirs@2", "ours@1", "alone@1"]
