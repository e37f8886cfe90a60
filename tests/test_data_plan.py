"""Properties of the bucketing plan over many random cases (hypothesis): every rank gets
the same number of batches, the shards are disjoint and complete, batches respect their
size or token budget, and the plan is a function of (seed, epoch)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringplug.data import plan_batches

cases = st.fixed_dictionaries(
    {
        "lengths": st.lists(st.integers(1, 500), min_size=0, max_size=300),
        "ranks": st.integers(1, 5),
        "by_tokens": st.booleans(),
        "batch_size": st.integers(1, 17),
        "budget_factor": st.integers(1, 8),
        "shuffle": st.booleans(),
        "seed": st.integers(0, 2**16),
        "epoch": st.integers(0, 50),
        "drop_last": st.booleans(),
    }
)


def plans(case: dict) -> list:
    limits = (
        {"max_tokens": 500 * case["budget_factor"]}
        if case["by_tokens"]
        else {"batch_size": case["batch_size"]}
    )
    return [
        plan_batches(
            case["lengths"],
            num_replicas=case["ranks"],
            rank=r,
            shuffle=case["shuffle"],
            seed=case["seed"],
            epoch=case["epoch"],
            drop_last=case["drop_last"],
            **limits,
        )
        for r in range(case["ranks"])
    ]


@settings(max_examples=300, deadline=None)
@given(cases)
def test_plans_are_equal_in_count_disjoint_complete_and_within_limits(case):
    every = plans(case)
    lengths = case["lengths"]
    # Same number of batches on every rank, whatever the sizes.
    assert len({len(p.batches) for p in every}) == 1
    seen = Counter(i for p in every for batch in p.batches for i in batch)
    repeated, dropped = every[0].repeated_samples, every[0].dropped_samples
    if case["drop_last"]:
        assert repeated == 0 and max(seen.values(), default=1) == 1  # each sample at most once
        assert sum(seen.values()) + dropped == len(lengths)
    else:
        assert dropped == 0 and set(seen) == set(range(len(lengths)))  # complete
        assert sum(seen.values()) - len(lengths) == repeated  # the only repeats are padding
    for p in every:
        for batch in p.batches:
            assert batch, "no empty batches"
            if case["by_tokens"]:
                assert max(lengths[i] for i in batch) * len(batch) <= 500 * case["budget_factor"]
            else:
                assert len(batch) <= case["batch_size"]


@settings(max_examples=100, deadline=None)
@given(cases)
def test_a_plan_depends_only_on_seed_and_epoch(case):
    assert [p.batches for p in plans(case)] == [p.batches for p in plans(case)]


@pytest.mark.parametrize("by_tokens", [False, True])
def test_another_seed_or_epoch_gives_another_plan(by_tokens):
    # The property above would pass if the seed were ignored: here it must change the plan.
    lengths = np.random.default_rng(0).integers(10, 400, 500).tolist()
    limits = {"max_tokens": 4000} if by_tokens else {"batch_size": 16}

    def plan(seed: int, epoch: int) -> list[list[int]]:
        return plan_batches(
            lengths, num_replicas=2, rank=0, seed=seed, epoch=epoch, **limits
        ).batches

    assert plan(0, 0) == plan(0, 0)
    assert plan(1, 0) != plan(0, 0) and plan(0, 1) != plan(0, 0) and plan(1, 0) != plan(0, 1)


def test_epochs_reorder_and_buckets_cut_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 400, 2000).tolist()
    first = plan_batches(lengths, batch_size=16, num_replicas=2, rank=0, epoch=0)
    second = plan_batches(lengths, batch_size=16, num_replicas=2, rank=0, epoch=1)
    assert first.batches != second.batches

    def padding(batches: list[list[int]]) -> int:
        return sum(
            max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches
        )

    order = rng.permutation(len(lengths)).tolist()
    random_batches = [order[i : i + 16] for i in range(0, len(order), 16)]
    both = [plan_batches(lengths, batch_size=16, num_replicas=2, rank=r) for r in range(2)]
    assert padding([b for p in both for b in p.batches]) * 5 < padding(random_batches)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one"),
        ({"batch_size": 2, "max_tokens": 9}, "exactly one"),
        ({"batch_size": 0}, "at least 1"),
        ({"max_tokens": 3}, "more than max_tokens=3"),
        ({"batch_size": 2, "rank": 2}, "rank 2"),
    ],
)
def test_bad_arguments_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_batches([1, 5, 2], num_replicas=kwargs.pop("num_replicas", 2), **kwargs)
