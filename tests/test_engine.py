"""The engine on real ranks: async submission, negotiation, fusion, join, stalls, timeline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "engine.py")


def run(scenario: str, tmp_path: Path, ranks: int = 3, **env: str):
    result = run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        WORKER,
        scenario,
        str(tmp_path),
        extra_env=env,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads((tmp_path / f"{scenario}-{r}.json").read_text()) for r in range(ranks)]
    return reports, result


@pytest.mark.parametrize(
    "env",
    [{}, {"RINGPLUG_RING_THRESHOLD": "0", "RINGPLUG_RING_SEGMENT": "4K"}],
    ids=["packed-into-the-fusion-buffer", "ring-over-the-tensors-in-place"],
)
def test_tensors_submitted_in_different_orders_reduce_correctly_and_fuse(tmp_path, env):
    reports, _ = run("orders", tmp_path, **env)
    for report in reports:
        assert report["ok"], report["bad"]
        assert report["grouped"] == [[6.0, 6.0, 6.0], [6.0, 6.0]]  # 1+2+3 and 0+2+4
        # 40 names agreed once each (plus the group, one request) live in the cache ...
        assert report["cache_slots"] == 41
        # ... and 123 allreduces ran as far fewer fused collectives.
        assert report["collectives"] < 40
    assert len({report["collectives"] for report in reports}) == 1  # same plan everywhere


def test_bursts_of_plain_arrays_of_every_type_reduce_in_place_or_into_new_arrays(tmp_path):
    reports, _ = run("plain", tmp_path)
    for report in reports:
        assert report["forms"] == 56
        assert report["bad"] == []


def test_the_same_name_twice_in_flight_is_refused(tmp_path):
    reports, _ = run("duplicate", tmp_path, ranks=2)
    for rank, report in enumerate(reports):
        assert f"A collective named 'dup' is already in flight on rank {rank}" in report["raised"]


def test_mismatched_named_tensors_fail_on_every_rank_naming_tensor_ranks_and_shapes(tmp_path):
    reports, _ = run("mismatch", tmp_path)
    for report in reports:
        kernel = report["kernel"]
        assert "'layer1/kernel' does not match across ranks" in kernel
        assert "rank 0 submitted allreduce with shape (3, 2) float32" in kernel
        assert "rank 2 submitted allreduce with shape (3, 4) float32" in kernel
        bias = report["bias"]
        assert "rank 0 submitted allreduce with shape (5,) float32" in bias
        assert "ranks 1, 2 submitted allreduce with shape (5,) float64" in bias


def test_joined_ranks_contribute_identities_and_everyone_learns_the_last_rank(tmp_path):
    reports, _ = run("join", tmp_path)
    longest = reports[2]  # rank r has r + 1 batches; ranks 0 and 1 join early
    assert longest["sums"] == [[6.0] * 3, [5.0] * 3, [3.0] * 3]  # joined ranks add 0
    assert longest["mins"] == [[1.0] * 2, [2.0] * 2, [3.0] * 2]  # ... and +inf to a min
    assert longest["means"] == [[6.0] * 2, [4.0] * 2, [2.0] * 2]  # Average still divides by 3
    assert [report["last"] for report in reports] == [2, 2, 2]
    assert all(report["after"] == [3.0, 3.0] for report in reports)


def test_a_stall_is_reported_by_rank_0_and_then_raised_on_every_rank(tmp_path):
    reports, result = run(
        "stall", tmp_path, RINGPLUG_STALL_CHECK_SECONDS="0.5", RINGPLUG_STALL_SHUTDOWN_SECONDS="1.5"
    )
    assert "[0] ringplug[0] WARNING" in result.stdout + result.stderr
    for report in reports:
        assert report["type"] == "StallError"
        assert "'only-on-rank-1' is ready on rank(s) 1 but not on rank(s) 0, 2" in report["error"]


def test_shutdown_keeps_finished_results_and_fails_what_never_ran(tmp_path):
    reports, _ = run("shutdown", tmp_path, ranks=2)
    for report in reports:
        assert report["kept"] == report["done_still"] == [3.0] * 4
        assert report["initialized"] is False
    assert "ringplug was shut down" in reports[0]["lonely"]


def test_waiting_for_a_late_rank_costs_under_a_tenth_of_a_core(tmp_path):
    reports, _ = run("idle_cpu", tmp_path, ranks=2)
    waited = reports[0]
    assert waited["wall_s"] > 0.5  # it really waited for the late rank
    assert waited["cpu_s"] / waited["wall_s"] < 0.10


def test_the_timeline_is_valid_json_with_a_row_per_tensor_and_every_phase(tmp_path):
    path = tmp_path / "timeline.json"
    run("timeline", tmp_path, ranks=2, RINGPLUG_TIMELINE=str(path))
    events = json.loads(path.read_text())
    phases = {event["name"] for event in events if event["ph"] == "X"}
    assert {"QUEUE", "NEGOTIATE", "COPY_IN", "ALLREDUCE", "COPY_OUT", "BROADCAST"} <= phases
    rows = {event["args"]["name"] for event in events if event["name"] == "thread_name"}
    assert {"grad0", "grad1", "grad2", "grad3", "params"} <= rows
    assert any(event["ph"] == "i" and event["name"].startswith("cycle ") for event in events)


def test_synchronous_calls_run_on_the_callers_thread_and_threads_get_their_own_results(tmp_path):
    reports, _ = run("callers", tmp_path, ranks=2)
    for report in reports:
        assert report["wrong"] == [] and report["alive"] == []
        # 40 synchronous allreduces in step on both ranks: the callers ran (most of) the
        # cycles themselves instead of handing each to the engine thread and back.
        assert report["driven"] > 0


@pytest.mark.parametrize("ranks", [2, 3])
def test_synchronous_calls_of_agreed_forms_run_at_once_and_fall_back_when_ranks_differ(
    tmp_path, ranks
):
    reports, _ = run("express", tmp_path, ranks=ranks)
    for report in reports:
        # The 20 synchronous calls' cycles took the negotiation's fast path ...
        assert report["fast_cycles"] >= 10
        assert report["sums_ok"]
        # ... but not the call for which rank 1 had another request in flight.
        assert report["fast_in_fallback"] == 0
        assert report["fallback_ok"] and report["extra_ok"]
        assert report["big_ok"] and 1 <= report["big_now"] <= 3
        assert report["mismatch"].startswith("MismatchError: 'sync' does not match across")
        assert "shape (5,)" in report["mismatch"] and "shape (4,)" in report["mismatch"]
        assert report["after"] == [float(ranks)] * 2


@pytest.mark.parametrize("ranks", [2, 3])
def test_small_allreduces_named_before_travel_in_the_negotiation_message(tmp_path, ranks):
    reports, _ = run("eager", tmp_path, ranks=ranks)
    for report in reports:
        bad = {key: case for key, case in report["cases"].items() if not case["ok"]}
        assert bad == {}
        # The first call of a name (or of an unnamed signature) is negotiated as new.
        assert all(case["paths"][1:] == ["eager", "eager"] for case in report["cases"].values())
        # Those calls ran their cycle on the caller's thread by the negotiation's fast path,
        # a prescale factor or a dtype given to reinterpret the buffer alike; the first call
        # of a name is negotiated as new (unnamed calls of one signature share their form).
        # (An idle engine thread that sees a peer's message first may answer it itself: a
        # call may not.)
        now = {key: case["now"] for key, case in report["cases"].items()}
        assert max(n for key, n in now.items() if key.startswith("named/")) <= 2
        assert sum(now.values()) >= len(now)
        assert report["in_place_ok"] == [True] * 3 and report["fresh_ok"] == [True] * 3
        assert report["in_place_now"] >= 2
        assert report["grouped"] == {"paths": ["mpi", "eager", "eager"], "ok": True}
        assert report["reshaped"] == [["mpi", True], ["eager", True], ["eager", True]] * 3
        assert report["big_path"] == "mpi" and report["big_ok"]
        assert report["many_ok"]
        assert "does not match across ranks" in report["mismatch"]
        assert "shape (3,)" in report["mismatch"] and "shape (4,)" in report["mismatch"]
        assert report["after"] == [float(ranks)] * 2
    # Every rank reduced the same copies in the same order: bitwise the same results.
    assert all(report["digests"] == reports[0]["digests"] for report in reports)
