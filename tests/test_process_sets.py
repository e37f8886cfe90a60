"""Process sets in the core: collectives over some of the world's ranks.

One ringrun job per world size (3 and 4 ranks) runs every scenario of
tests/workers/process_sets.py; each test reads the ranks' reports of that job.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ringplug
from launch import run_ringrun

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from process_sets import KINDS, expected_case_names  # noqa: E402

from ringplug.core.errors import MismatchError  # noqa: E402
from ringplug.core.process_sets import agreed_ranks  # noqa: E402
from ringplug.core.transport.waiting import Notice, peer_failed_error  # noqa: E402

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """``reports(ranks)``: each rank's report of the job on `ranks` ranks (run once)."""
    jobs: dict[int, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def read(ranks: int) -> list[dict]:
        if ranks not in jobs:
            outdir = tmp_path_factory.mktemp(f"process-sets-{ranks}")
            result = run_ringrun(
                "-np",
                str(ranks),
                sys.executable,
                str(WORKERS / "process_sets.py"),
                str(outdir),
                extra_env={
                    "RINGPLUG_TIMELINE": str(outdir / "trace.json"),
                    # Under the barrier's own timeout (2 s), so the set's rank 0 (the world's
                    # rank 1) reports the stall before the barrier fails.
                    "RINGPLUG_STALL_CHECK_SECONDS": "0.5",
                },
                timeout=240,
            )
            jobs[ranks] = (result, outdir)
        result, outdir = jobs[ranks]
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        found = [json.loads((outdir / f"sets-{r}.json").read_text()) for r in range(ranks)]
        trace = json.loads((outdir / "trace.json").read_text())
        return [*found, trace, result.stdout + result.stderr]

    return read


def _failed(report: dict, prefix: str = "") -> dict:
    return {n: c["detail"] for n, c in report.items() if n.startswith(prefix) and not c["ok"]}


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_every_rank_reports_every_scenario_of_its_sets(reports, ranks):
    for rank, report in enumerate(reports(ranks)[:-2]):
        assert sorted(report) == sorted(expected_case_names(rank, ranks)), rank


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_every_collective_kind_on_a_set_matches_numpy(reports, ranks):
    for rank, report in enumerate(reports(ranks)[:-2]):
        kinds = {n: c for n, c in report.items() if n.split("/", 1)[-1] in KINDS or n == "C/adasum"}
        assert kinds, rank
        assert not _failed(kinds), f"rank {rank}: {_failed(kinds)}"


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_overlapping_sets_and_the_world_run_with_work_in_flight_at_once(reports, ranks):
    for rank, report in enumerate(reports(ranks)[:-2]):
        case = report["overlapping-sets-in-flight"]
        assert case["ok"], f"rank {rank}: {case['detail']}"


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_bad_sets_fail_alike_on_every_rank_and_the_world_goes_on(reports, ranks):
    for rank, report in enumerate(reports(ranks)[:-2]):
        assert not _failed(report, "bad/"), f"rank {rank}: {_failed(report, 'bad/')}"
        assert not _failed(report, "world-"), f"rank {rank}: {_failed(report, 'world-')}"
        assert report["ids-agree"]["ok"]


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_a_set_made_by_its_members_only_runs_every_kind_while_its_non_member_is_away(
    reports, ranks
):
    found = reports(ranks)[:-2]
    for rank, report in enumerate(found[:-1]):  # the members: 0..ranks-2
        assert not _failed(report, "L/"), f"rank {rank}: {_failed(report, 'L/')}"
        assert {"L/allreduce-sum", "L/alltoall", "L/join"} <= set(report), rank
    blocked = found[-1]["L/non-member-blocked-meanwhile"]
    assert blocked["ok"] and "made, used and removed" in blocked["detail"], blocked


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_an_any_source_any_tag_receive_on_the_world_never_takes_a_members_only_proposal(
    reports, ranks
):
    # Rank 0 had it pending while it made L with ranks 1..p-2; rank p-1 sent the message.
    case = reports(ranks)[0]["L/any-source-receive-takes-the-applications-message"]
    assert case["ok"], case["detail"]
    assert case["detail"] == f"from rank {ranks - 1}, tag 7: ('application', {ranks - 1})"


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_disjoint_ranks_make_members_only_sets_at_once_with_ids_of_their_own(reports, ranks):
    for rank, report in enumerate(reports(ranks)[:-2]):
        for case in ("PQ/disjoint-sets-at-once", "PQ/ids-unique-and-counted"):
            assert report[case]["ok"], f"rank {rank} {case}: {report[case]['detail']}"
    # The ids every rank saw, as the worker's check compared them (P = 0 and the last rank).
    assert (
        f"'[0,{ranks - 1}]#0', '[0,{ranks - 1}]#1'"
        in reports(ranks)[0]["PQ/ids-unique-and-counted"]["detail"]
    )


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_bad_members_only_sets_are_refused_on_the_ranks_concerned(reports, ranks):
    found = reports(ranks)[:-2]
    for rank, report in enumerate(found):
        assert not _failed(report, "local-bad/"), f"rank {rank}: {_failed(report, 'local-bad/')}"
    # Rank 1 passed [0, 1] and heard of rank 0's duplicate; the pair P refused a world removal.
    assert "rank 0 passed rank 1 more than once" in found[1]["local-bad/duplicate-ranks"]["detail"]
    assert (
        "local-bad/removed-by-the-world" in found[0]
        and "local-bad/removed-by-the-world" in (found[-1])
    )


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_a_non_member_is_refused_and_errors_name_world_ranks_and_the_set(reports, ranks):
    for rank, report in enumerate(reports(ranks)[:-2]):
        named = {
            n: c
            for n, c in report.items()
            if n.endswith(("refused-on-a-non-member", "names-tensor-and-set", "names-world-rank"))
        }
        assert not _failed(named), f"rank {rank}: {_failed(named)}"
    # Rank 1 is in set B, whose other member is the last rank.
    assert "B/mismatch-names-tensor-and-set" in reports(ranks)[1]


@pytest.mark.multirank
def test_a_sets_collectives_are_on_rank_zeros_timeline(reports):
    trace = reports(3)[-2]
    rows = {e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    # 'a2a' is an alltoall that only sets run (rank 0 is in two of them); the world's own
    # collectives are there too.
    spans = {e["name"] for e in trace if e.get("ph") == "X"}
    assert {"a2a", "overlap"} <= rows, sorted(rows)
    assert "ALLTOALL" in spans, sorted(spans)


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4])
def test_a_sets_stall_is_reported_by_its_first_member_naming_world_ranks(reports, ranks):
    output = reports(ranks)[-1]
    # Set B is ranks 1 and the last; only rank 1 called its barrier 'lonely'.
    assert (
        f"Stalled collectives: 'lonely' is ready on rank(s) 1 but not on rank(s) {ranks - 1}"
        in output
    ), output[-3000:]


def test_a_peers_failure_is_named_by_its_rank_in_the_world():
    notice = Notice(1, 4, 0, "allreduce 'x'", "MemoryError: no", named=3)
    error = peer_failed_error(notice, "allreduce 'x'")
    assert str(error).startswith("rank 3 failed allreduce 'x'")
    assert error.caused_by == (3,)


def test_a_world_of_one_makes_runs_and_removes_a_set_of_its_one_rank():
    ringplug.init()
    try:
        process_set = ringplug.add_process_set([0])
        assert (process_set.included(), process_set.rank(), process_set.size()) == (True, 0, 1)
        assert process_set.allreduce(np.arange(3.0), op=ringplug.Sum).tolist() == [0, 1, 2]
        ringplug.remove_process_set(process_set)
        with pytest.raises(ringplug.RingplugError, match="process set 1 .* was removed"):
            process_set.allreduce(np.ones(1))
    finally:
        ringplug.shutdown()


def test_ranks_given_in_any_order_make_one_set():
    assert agreed_ranks([(2, 0), (0, 2), (2, 0)], 3, 1) == (0, 2)


def test_every_wrong_proposal_is_named_before_any_disagreement():
    with pytest.raises(ValueError, match=r"rank 1 passed rank 5, outside the world of 3") as info:
        agreed_ranks([(0, 1), (0, 5), (1, 1)], 3, 7)
    assert "rank 2 passed rank 1 more than once" in str(info.value)
    assert "process set 7" in str(info.value)


def test_ranks_that_disagree_are_grouped_by_what_they_passed():
    with pytest.raises(MismatchError, match=r"ranks 0, 2 passed \[0, 1\]; rank 1 passed \[1, 2\]"):
        agreed_ranks([(0, 1), (1, 2), (1, 0)], 3, 1)


def test_an_empty_set_is_refused():
    with pytest.raises(ValueError, match="rank 0 passed no ranks"):
        agreed_ranks([()], 1, 1)
