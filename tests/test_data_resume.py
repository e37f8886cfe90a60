"""Resuming an epoch midway, by a job with another number of ranks (elastic training): the
samples trained before the stop are not trained again, none of the others is skipped, and
every rank of each job gets the same number of batches. Both samplers, in one process: the
ranks of each job are samplers with explicit ``num_replicas`` and ``rank``.

The ledger tests keep their own account of what each rank trained (the ids in the batches
taken from the samplers) and judge it by counting, not by the code under test."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from launch import run_ringrun
from ringplug.data import plan_batches, trained_samples

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from ringplug.data import DistributedBucketSampler, ElasticSampler  # noqa: E402

COUNT = 257  # a prime: no world size divides it, so every plan needs padding
LENGTHS = np.random.default_rng(7).integers(1, 300, COUNT).tolist()
BATCH = 5  # the DataLoader batch size for ElasticSampler
BUDGET = 1500  # max_tokens

KINDS = ["bucket-batch_size", "bucket-max_tokens", "elastic"]


def sampler(kind: str, replicas: int, rank: int, shuffle: bool = True, **extra):
    if kind == "bucket-batch_size":
        return DistributedBucketSampler(
            LENGTHS,
            batch_size=7,
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=11,
            **extra,
        )
    if kind == "bucket-max_tokens":
        return DistributedBucketSampler(
            LENGTHS,
            max_tokens=BUDGET,
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=11,
            **extra,
        )
    return ElasticSampler(
        range(COUNT),
        shuffle=shuffle,
        seed=11,
        num_replicas=replicas,
        rank=rank,
        batch_size=BATCH,
        **extra,
    )


def batches_of(walk: list) -> list[list[int]]:
    """A rank's batches: a batch sampler's as they come, a sampler's ids cut as a DataLoader
    with ``batch_size=BATCH`` cuts them."""
    if walk and isinstance(walk[0], list):
        return walk
    return [walk[i : i + BATCH] for i in range(0, len(walk), BATCH)]


def len_in_batches(made) -> int:
    """``len()`` in batches: a batch sampler's own, a sampler's samples in DataLoader batches."""
    return len(made) if isinstance(made, DistributedBucketSampler) else -(-len(made) // BATCH)


def through(state: dict, how: str) -> dict:
    """`state` after a trip through a checkpoint file."""
    if how == "pickle":
        return pickle.loads(pickle.dumps(state))
    if how == "json":
        return json.loads(json.dumps(state))
    buffer = io.BytesIO()
    torch.save({"sampler": state}, buffer)
    buffer.seek(0)
    return torch.load(buffer)["sampler"]  # weights_only, torch's default


STOPS: dict[str, Callable[[int], int]] = {
    "none": lambda n: 0,
    "one": lambda n: min(1, n),
    "half": lambda n: n // 2,
    "all-but-one": lambda n: max(n - 1, 0),
    "all": lambda n: n,
}


def train_epoch(
    kind: str, worlds: tuple[int, ...], stops: tuple[str, ...], shuffle: bool, epoch: int = 3
) -> list[list[list[list[int]]]]:
    """Epoch `epoch` in jobs of `worlds` ranks: each job but the last trains its ranks' first
    batches (`stops`, one a job but the last), then rank 0's state goes through a checkpoint
    to the next job, whose ranks load it; the last job trains to the end of the epoch.

    Returns, per job, per rank, the batches it trained. Checks on the way what holds in
    every job: each rank is given the same number of batches, as many as ``len()`` says.
    """
    jobs = []
    state = None
    done = 0  # the epoch's batches per rank so far: Lightning's count
    for job, replicas in enumerate(worlds):
        ranks = [sampler(kind, replicas, r, shuffle) for r in range(replicas)]
        for rank_sampler in ranks:
            if state is not None:
                rank_sampler.load_state_dict(state)
            rank_sampler.set_epoch(epoch)  # as Lightning does for the epoch it resumes
        walks = [batches_of(list(rank_sampler)) for rank_sampler in ranks]
        counts = {len(walk) for walk in walks}
        assert len(counts) == 1, f"job {job}: ranks got {[len(w) for w in walks]} batches"
        assert {len_in_batches(s) for s in ranks} == counts  # len() agrees
        if job == len(worlds) - 1:
            jobs.append(walks)
            break
        stop = STOPS[stops[job]](counts.pop())
        jobs.append([walk[:stop] for walk in walks])
        done += stop
        how = ("pickle", "torch", "json")[job % 3]
        state = through(ranks[0].state_dict(batches_done=done), how)
    return jobs


def assert_each_sample_trained_once(jobs: list, replicas: tuple[int, ...]) -> None:
    """The ledger: every sample trained, none trained in two jobs, and within a job repeats
    only in the padding, which sits in the ranks' last batches."""
    seen_before: set[int] = set()
    for job, (walks, ranks) in enumerate(zip(jobs, replicas, strict=True)):
        ids = Counter(i for walk in walks for batch in walk for i in batch)
        again = seen_before & set(ids)
        assert not again, f"job {job} trained {sorted(again)[:10]}, trained before the resume"
        # Before the last round there is no padding: no sample twice.
        early = Counter(i for walk in walks for batch in walk[:-1] for i in batch)
        assert max(early.values(), default=1) == 1, f"job {job}: repeats before the last round"
        padding = sum(ids.values()) - len(ids)
        assert padding <= (ranks - 1) * max((len(b) for w in walks for b in w), default=0)
        # A rest of fewer batches than ranks is dealt to every rank, so up to `ranks` times.
        assert max(ids.values(), default=1) <= ranks
        seen_before |= set(ids)
    skipped = set(range(COUNT)) - seen_before
    assert not skipped, f"samples {sorted(skipped)[:10]} were never trained"


def assert_batches_keep_the_rules(kind: str, jobs: list) -> None:
    for walks in jobs:
        for walk in walks:
            for batch in walk:
                assert batch
                if kind == "bucket-max_tokens":
                    assert max(LENGTHS[i] for i in batch) * len(batch) <= BUDGET
                else:
                    assert len(batch) <= (7 if kind == "bucket-batch_size" else BATCH)


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("worlds", [(3, 2), (2, 3)], ids=["3-to-2", "2-to-3"])
def test_a_resumed_epoch_trains_every_sample_once(kind, worlds, stop, shuffle):
    jobs = train_epoch(kind, worlds, (stop,), shuffle)
    assert_each_sample_trained_once(jobs, worlds)
    assert_batches_keep_the_rules(kind, jobs)


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "stops",
    [("half", "half"), ("none", "half"), ("one", "all-but-one"), ("half", "all"), ("all", "none")],
    ids="-then-".join,
)
def test_resumes_chain_within_an_epoch_from_3_to_2_to_1_ranks(kind, stops, shuffle):
    jobs = train_epoch(kind, (3, 2, 1), stops, shuffle)
    assert_each_sample_trained_once(jobs, (3, 2, 1))
    assert_batches_keep_the_rules(kind, jobs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_resume_from_nothing_done_gives_the_plan_the_epoch_had(kind):
    fresh = sampler(kind, 2, 1)
    fresh.set_epoch(4)
    state = through(fresh.state_dict(batches_done=0), "pickle")
    resumed = sampler(kind, 2, 1)
    resumed.load_state_dict(state)
    assert list(resumed) == list(fresh)


@pytest.mark.parametrize("kind", KINDS)
def test_the_next_epoch_is_whole_again(kind):
    stopped = sampler(kind, 3, 0)
    stopped.set_epoch(5)
    state = stopped.state_dict(batches_done=4)
    resumed = sampler(kind, 2, 1)
    resumed.load_state_dict(state)
    resumed.set_epoch(5)  # the resumed epoch keeps its resumed plan
    assert resumed.epoch == 5 and resumed.resumed_batches == 4
    ids = [i for batch in batches_of(list(resumed)) for i in batch]
    assert len(ids) < COUNT - 3 * 4  # the rest only (padding aside)
    resumed.set_epoch(6)
    normal = sampler(kind, 2, 1)
    normal.set_epoch(6)
    assert resumed.resumed_batches == 0
    assert list(resumed) == list(normal) and len(resumed) == len(normal)


def sampler_at(kind: str, replicas: int, rank: int, epoch: int):
    made = sampler(kind, replicas, rank)
    made.set_epoch(epoch)
    return made


@pytest.mark.parametrize("kind", KINDS)
def test_without_a_count_the_state_counts_what_the_iterator_gave_out(kind):
    counted = sampler(kind, 3, 0)
    counted.set_epoch(2)
    walk = iter(counted)
    per_batch = 1 if isinstance(counted, DistributedBucketSampler) else BATCH
    for _ in range(4 * per_batch):
        next(walk)
    assert counted.state_dict() == sampler_at(kind, 3, 0, 2).state_dict(batches_done=4)
    # And after a resume, the count goes on from the batches trained before it.
    resumed = sampler(kind, 2, 1)
    resumed.load_state_dict(counted.state_dict())
    walk = iter(resumed)
    for _ in range(3 * per_batch):
        next(walk)
    assert resumed.state_dict() == resumed.state_dict(batches_done=4 + 3)
    assert resumed.state_dict()["batches"] == 7


@pytest.mark.parametrize("kind", KINDS)
def test_state_is_plain_data_that_survives_pickle_torch_save_and_json(kind):
    stopped = sampler_at(kind, 3, 2, 1)
    state = stopped.state_dict(batches_done=3)
    for how in ("pickle", "torch", "json"):
        assert through(state, how) == state
    assert state["epoch"] == 1 and state["seed"] == 11 and state["samples"] == COUNT
    assert state["version"] == 1 and state["batches"] == 3
    # Compact: a bit per sample (base64), not an index list.
    assert len(state["done"]) <= 4 * ((COUNT + 7) // 8 + 2) // 3 + 4
    assert 0 < state["done_samples"] < COUNT


@pytest.mark.parametrize("kind", KINDS)
def test_the_resumed_epoch_takes_the_states_seed(kind):
    state = sampler_at(kind, 3, 0, 2).state_dict(batches_done=2)
    if kind.startswith("bucket"):
        other_seed = DistributedBucketSampler(LENGTHS, batch_size=7, num_replicas=2, seed=99)
    else:
        other_seed = ElasticSampler(range(COUNT), seed=99, num_replicas=2, batch_size=BATCH)
    other_seed.load_state_dict(state)
    assert other_seed.seed == 11 and other_seed.epoch == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_of_another_dataset_length_is_refused_saying_what_to_do(kind):
    state = sampler_at(kind, 2, 0, 0).state_dict(batches_done=1)
    shorter = (
        DistributedBucketSampler(LENGTHS[:-1], batch_size=7, num_replicas=2, rank=0)
        if kind.startswith("bucket")
        else ElasticSampler(range(COUNT - 1), num_replicas=2, rank=0)
    )
    with pytest.raises(ValueError, match=rf"dataset of {COUNT} samples.*has {COUNT - 1}.*same"):
        shorter.load_state_dict(state)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "version 2; this ringplug reads version 1"),
        ({"version": None}, "version None"),
        ({"done": "not base64!"}, "not base64"),
        ({"done": "AAAA"}, "damaged"),
        ({"done_samples": 0}, "damaged"),
    ],
)
def test_an_unknown_version_or_damaged_state_is_refused(kind, change, message):
    state = {**sampler_at(kind, 2, 0, 0).state_dict(batches_done=2), **change}
    with pytest.raises(ValueError, match=message):
        sampler(kind, 2, 0).load_state_dict(state)


def test_a_state_of_the_other_sampler_or_not_a_state_is_refused():
    bucket = sampler_at("bucket-batch_size", 2, 0, 0)
    elastic = sampler_at("elastic", 2, 0, 0)
    with pytest.raises(ValueError, match="DistributedBucketSampler's.*Load it into a Distri"):
        elastic.load_state_dict(bucket.state_dict(batches_done=1))
    with pytest.raises(ValueError, match="ElasticSampler's"):
        bucket.load_state_dict(elastic.state_dict(batches_done=1))
    with pytest.raises(ValueError, match=r"not a sampler state.*state_dict\(\)"):
        bucket.load_state_dict({"epoch": 3})


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_count_the_epoch_cannot_have_is_refused(kind):
    stopped = sampler_at(kind, 3, 0, 0)
    per_rank = len(batches_of(list(stopped)))
    assert stopped.state_dict(batches_done=per_rank)["done_samples"] == COUNT
    with pytest.raises(ValueError, match=f"from 0 to {per_rank}"):
        stopped.state_dict(batches_done=per_rank + 1)
    resumed = sampler(kind, 2, 0)
    resumed.load_state_dict(stopped.state_dict(batches_done=5))
    # The count is the epoch's (Lightning's), so it cannot go below the 5 before the resume.
    with pytest.raises(ValueError, match="5 of them trained before its resume"):
        resumed.state_dict(batches_done=2)


def test_resumed_batches_still_bucket_by_length():
    stopped = DistributedBucketSampler(LENGTHS * 8, batch_size=16, num_replicas=3, rank=0)
    state = stopped.state_dict(batches_done=10)
    resumed = [
        DistributedBucketSampler(LENGTHS * 8, batch_size=16, num_replicas=2, rank=r)
        for r in range(2)
    ]
    for each in resumed:
        each.load_state_dict(state)
    lengths = LENGTHS * 8

    def padding(batches: list[list[int]]) -> int:
        return sum(
            max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches
        )

    batches = [b for each in resumed for b in each]
    rest = [i for b in batches for i in b]
    order = np.random.default_rng(0).permutation(rest).tolist()
    random_batches = [order[i : i + 16] for i in range(0, len(order), 16)]
    assert padding(batches) * 5 < padding(random_batches)


def test_unshuffled_elastic_sampler_deals_as_torchs_distributed_sampler():
    for drop_last in (False, True):
        for replicas in (2, 3, 4):
            options = {"shuffle": False, "num_replicas": replicas, "drop_last": drop_last}
            ours = [list(ElasticSampler(range(COUNT), rank=r, **options)) for r in range(replicas)]
            torchs = [
                list(DistributedSampler(range(COUNT), rank=r, **options)) for r in range(replicas)
            ]
            assert ours == torchs


def test_elastic_sampler_with_drop_last_trains_each_sample_at_most_once():
    jobs = []
    first = [sampler("elastic", 3, r, drop_last=True) for r in range(3)]
    jobs.append([batches_of(list(s))[:4] for s in first])
    state = first[0].state_dict(batches_done=4)
    second = [sampler("elastic", 2, r, drop_last=True) for r in range(2)]
    for each in second:
        each.load_state_dict(state)
    jobs.append([batches_of(list(s)) for s in second])
    ids = Counter(i for job in jobs for walk in job for batch in walk for i in batch)
    assert max(ids.values()) == 1
    assert COUNT - len(ids) < 2  # at most one left out, to make 2 ranks equal
    assert len({len(list(s)) for s in second}) == 1


def test_record_batch_counts_as_horovod_records_it():
    # Horovod's loop: record_batch(batch_idx, batch_size) after each batch of
    # enumerate(loader); the state then holds every rank's trained samples.
    recording = ElasticSampler(range(COUNT), seed=11, num_replicas=3, rank=0)  # no batch_size
    recording.set_epoch(1)
    loader = DataLoader(range(COUNT), batch_size=BATCH, sampler=recording)
    for batch_idx, batch in enumerate(loader):
        assert batch.tolist() == recording.get_indices(batch_idx, BATCH)
        recording.record_batch(batch_idx, BATCH)
        if batch_idx == 5:
            break
    assert recording.state_dict() == sampler_at("elastic", 3, 0, 1).state_dict(batches_done=6)
    assert recording.state_dict()["done_samples"] == 3 * 6 * BATCH


def test_record_indices_marks_those_samples_trained():
    recording = sampler_at("elastic", 2, 0, 0)
    recording.record_indices([3, 5, 250])
    state = recording.state_dict(batches_done=0)
    assert state["done_samples"] == 3
    resumed = ElasticSampler(range(COUNT), num_replicas=1, rank=0)
    resumed.load_state_dict(state)
    assert sorted(resumed) == sorted(set(range(COUNT)) - {3, 5, 250})


def test_reset_plans_the_rest_of_the_epoch_again():
    ranks = [sampler_at("elastic", 2, r, 0) for r in range(2)]
    walks = [list(s) for s in ranks]
    for each in ranks:
        each.record_batch(3, BATCH)
        each.reset()
    trained = {i for walk in walks for i in walk[: 4 * BATCH]}
    rest = [list(s) for s in ranks]
    assert len(rest[0]) == len(rest[1]) == (COUNT - len(trained) + 1) // 2
    assert not trained & {i for walk in rest for i in walk}
    assert trained | {i for walk in rest for i in walk} == set(range(COUNT))


def test_elastic_sampler_is_exported_without_importing_torch_at_import_ringplug_data():
    code = (
        "import sys, ringplug.data; assert 'torch' not in sys.modules; "
        "from ringplug.data import ElasticSampler; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# The framework-neutral pieces the samplers rest on.


@pytest.mark.parametrize("limits", [{"batch_size": 6}, {"max_tokens": BUDGET}])
def test_a_plan_of_a_subset_holds_the_subset_and_equal_counts(limits):
    subset = np.random.default_rng(3).choice(COUNT, 100, replace=False)
    plans = [
        plan_batches(LENGTHS, num_replicas=3, rank=r, indices=subset, **limits) for r in range(3)
    ]
    ids = Counter(i for p in plans for b in p.batches for i in b)
    assert set(ids) == set(subset.tolist())
    assert sum(ids.values()) - len(subset) == plans[0].repeated_samples
    assert len({len(p.batches) for p in plans}) == 1
    whole = plan_batches(LENGTHS, num_replicas=3, rank=1, indices=range(COUNT), **limits)
    assert whole == plan_batches(LENGTHS, num_replicas=3, rank=1, **limits)


@pytest.mark.parametrize("limits", [{"batch_size": 6}, {"max_tokens": BUDGET}])
def test_trained_samples_are_the_ranks_first_batches_together(limits):
    plans = [plan_batches(LENGTHS, num_replicas=3, rank=r, epoch=2, **limits) for r in range(3)]
    for batches in (0, 1, 7, len(plans[0].batches)):
        held = {i for p in plans for b in p.batches[:batches] for i in b}
        got = trained_samples(LENGTHS, batches, num_replicas=3, epoch=2, **limits)
        assert got.tolist() == sorted(held)
    with pytest.raises(ValueError, match="batches per rank"):
        trained_samples(LENGTHS, len(plans[0].batches) + 1, num_replicas=3, epoch=2, **limits)


@pytest.mark.parametrize(
    ("indices", "message"),
    [([0, COUNT], "sample ids in 0"), ([-1], "sample ids in 0"), ([4, 4], "more than once")],
)
def test_bad_subsets_are_refused(indices, message):
    with pytest.raises(ValueError, match=message):
        plan_batches(LENGTHS, batch_size=4, indices=indices)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["bucket", "elastic"])
def test_real_ranks_resume_an_epoch_with_fewer_ranks_through_loader_workers(tmp_path, kind):
    # 3 ranks train 4 batches each (their DataLoader workers fetching ahead), rank 0 saves the
    # state; 2 ranks, finding their world from ringrun, load it and train the rest.
    worker = str(Path(__file__).parent / "workers" / "data_resume.py")
    jobs = []
    for ranks, stop in ((3, 4), (2, -1)):
        result = run_ringrun(
            "-np",
            str(ranks),
            sys.executable,
            worker,
            kind,
            str(stop),
            str(tmp_path),
            extra_env={"RINGPLUG_TIMEOUT": "60"},
            timeout=240,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        reports = [
            json.loads((tmp_path / f"{kind}-{ranks}-{r}.json").read_text()) for r in range(ranks)
        ]
        assert len({report["len"] for report in reports}) == 1  # equal counts: no hang
        assert {report["batches"] for report in reports} == {4 if stop > 0 else reports[0]["len"]}
        jobs.append([report["ids"] for report in reports])
    before = [i for ids in jobs[0] for i in ids]
    after = Counter(i for ids in jobs[1] for i in ids)
    assert len(set(before)) == len(before)  # the first job stopped before any padding
    assert not set(before) & set(after), "samples trained before the resume were trained again"
    assert set(before) | set(after) == set(range(101)), "samples were skipped"
    assert max(after.values()) <= 2  # the padding of two ranks repeats a sample at most once
    if kind == "elastic":
        assert sum(after.values()) - len(after) <= 1
