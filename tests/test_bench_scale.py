"""`ringplug-bench scale`: its counts on a few ranks, and its cost model on points whose
answer is known. Nothing here asserts how fast anything was."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from ringplug.bench import scale_model
from ringplug.bench.scale_job import CallCounter
from ringplug.bench.scale_model import (
    CallFit,
    CpuModel,
    Fit,
    Point,
    StepPoint,
    fit_calls,
    fit_model,
)


@pytest.mark.multirank
def test_counts_on_2_and_3_ranks_are_ceil_log2_p_messages_a_cycle_as_profiled(tmp_path):
    output = tmp_path / "scale.json"
    result = subprocess.run(
        [sys.executable, "-m", "ringplug.bench.cli", "scale", "--ranks", "2,3",
         "--parts", "counts,cpu,model", "--steps", "2", "--cpu-steps", "2", "--json", str(output)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(output.read_text())
    for size in (2, 3):
        reports = document["counts"][str(size)]["reports"]
        assert [report["rank"] for report in reports] == list(range(size))
        for report in reports:
            step = report["phases"]["8x4K"]
            # Up to 7 ranks every cycle gathers the messages in ceil(log2 p) rounds.
            rounds = math.ceil(math.log2(size))
            assert step["messages"]["negotiation"] == rounds * step["cycles"]
            if "pmpi" in report:  # the profiling library built here: the same counts
                assert report["pmpi"]["messages"] == sum(report["window"]["messages"].values())
                assert report["pmpi"]["bytes"] == sum(report["window"]["bytes"].values())
    # A row per size in the counts table, then one per size and step in the CPU table.
    sizes = [line.split()[0] for line in result.stdout.splitlines() if line[:6].strip().isdigit()]
    assert sizes == ["2", "3"] + ["2"] * 3 + ["3"] * 3
    for size in (2, 3):
        for report in document["calls"][str(size)]["reports"]:
            one, many = report["phases"]["1x4K"], report["phases"]["32x4K"]
            # Without a job of 8 ranks nothing doubles; the gathered agreement has calls.
            assert one["calls"]["doubling"] == many["calls"]["doubling"] == 0
            assert one["calls"]["agreement"] > 0
            # 31 more tensors make more calls outside the agreement, none inside it
            # beyond what taking in their forms costs.
            assert many["calls"]["rest"] > one["calls"]["rest"] + 31
    predicted = document["model"]["predictions"]
    assert {row["ranks"] for row in predicted} == {64, 512, 4096}
    assert all(0 < row["efficiency"] <= 1 for row in predicted)


@pytest.mark.multirank
def test_a_set_of_4_inside_16_ranks_sends_what_a_world_of_4_sends(tmp_path):
    # Issue 48's target: a set's collectives cost what k ranks cost, whatever p is.
    output = tmp_path / "sets.json"
    result = subprocess.run(
        [sys.executable, "-m", "ringplug.bench.cli", "scale", "--parts", "sets",
         "--sets", "16:4", "--steps", "3", "--json", str(output)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {job["ranks"]: job for job in json.loads(output.read_text())["sets"]}
    assert sorted(jobs) == [4, 16]
    data = {}
    for p, job in jobs.items():
        members = [report["rank"] for report in job["reports"]]
        assert members == list(range(0, p, p // 4)), members  # spread over the world
        for report in job["reports"]:
            step = report["phases"]["8x4K"]
            # Every agreed cycle gathers in ceil(log2 4) = 2 rounds, on the set's engine.
            assert step["messages"]["negotiation"] == 2 * step["cycles"], (p, step)
            assert report["world_engine"] == {}, (p, report["world_engine"])
            if "pmpi" in report:  # the process sent nothing the set's engine did not count
                assert report["pmpi"]["messages"] == sum(report["window"]["messages"].values())
                assert report["pmpi"]["bytes"] == sum(report["window"]["bytes"].values())
            medium = report["phases"]["1M"]
            data[p, members.index(report["rank"])] = (
                medium["messages"]["data"],
                medium["bytes"]["data"],
            )
    # The 1 MiB allreduce's data moves exactly as in a world of 4, member by member.
    assert [data[16, i] for i in range(4)] == [data[4, i] for i in range(4)]


def test_the_fit_recovers_the_coefficients_that_made_the_points():
    alpha, beta, gamma = 7e-6, 0.4e-9, 3e-6
    shapes = [(1, 4096, 10), (3, 1 << 20, 12), (18, 16 << 20, 20), (5, 0, 9), (40, 2e6, 60)]
    points = [
        Point(f"p{i}", m, b, c, alpha * m + beta * b + gamma * c)
        for i, (m, b, c) in enumerate(shapes)
    ]
    fit = fit_model(points)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.beta == pytest.approx(beta, rel=1e-9)
    assert fit.gamma == pytest.approx(gamma, rel=1e-9)
    assert fit.rms_error == pytest.approx(0, abs=1e-9)


def test_the_fit_keeps_every_coefficient_at_least_zero_and_reports_its_error():
    # Time falls as messages grow: unconstrained least squares would give a negative alpha.
    points = [Point("a", 1, 0, 1, 3e-6), Point("b", 2, 0, 1, 2e-6), Point("c", 4, 0, 1, 1e-6)]
    fit = fit_model(points)
    assert fit.alpha == 0 and fit.beta == 0 and fit.gamma > 0
    assert set(fit.errors) == {"a", "b", "c"}
    assert fit.errors["a"] < 0 < fit.errors["c"]


def test_with_python_free_the_prediction_is_nccls_data_plane_and_latency():
    free = Fit(0.0, 0.0, 0.0, {})
    no_calls = CpuModel(CallFit(0.0, 0.0, 0.0, 0.0, 0.0, {}), 1e-6)
    model, network = scale_model.HOROVOD_MODELS[0], scale_model.ROCE
    row = scale_model.predict(free, no_calls, model, network, 512, "free")
    buffers = math.ceil(model.gradient_bytes / scale_model.FUSION_BYTES)
    data = 2 * 511 / 512 * model.gradient_bytes / network.busbw_bytes_s
    data += buffers * 2 * 9 * network.latency_s
    # What is left of the control plane: NCCL's latency for each negotiation message.
    assert row.engine_cpu_per_cycle_s == 0
    assert row.control_s == pytest.approx((buffers + 1) * 9 * network.latency_s)
    assert row.data_s == pytest.approx(data)
    control = row.control_s
    assert row.efficiency_no_overlap == pytest.approx(
        model.compute_s / (model.compute_s + control + data)
    )


def test_the_call_fit_recovers_the_calls_that_made_the_points():
    # rest = 80 + 45 tensors; agreement = 10 + 12 rounds; doubling = 20 a round.
    shapes = [(1, 3, 3), (8, 3, 3), (32, 3, 3), (1, 4, 0), (8, 4, 0), (8, 5, 0)]
    points = [
        StepPoint(f"s{i}", n, r, d, 10 + 12 * r, 20 * d, 80 + 45 * n)
        for i, (n, r, d) in enumerate(shapes)
    ]
    fit = fit_calls(points)
    assert fit.per_cycle == pytest.approx(80)
    assert fit.per_tensor == pytest.approx(45)
    assert fit.agreement_once == pytest.approx(10)
    assert fit.agreement_per_round == pytest.approx(12)
    assert fit.doubling_per_round == pytest.approx(20)
    assert fit.rms_error == pytest.approx(0, abs=1e-9)
    # 512 ranks: 9 rounds; 2 tensors.
    assert fit.cycle(512, 2, doubling=False) == pytest.approx(80 + 90 + 10 + 108)
    assert fit.cycle(512, 2, doubling=True) == pytest.approx(80 + 90 + 10 + 108 + 180)
    cpu = CpuModel(fit, 0.5e-6)
    expected = 0.5e-6 * (80 + 10 + 108)
    assert scale_model.engine_cpu_per_cycle(cpu, 512) == pytest.approx(expected)
    with_doubling = scale_model.engine_cpu_per_cycle(cpu, 512, tensors=1, doubling=True)
    assert with_doubling == pytest.approx(expected + 0.5e-6 * (45 + 180))


def _test(polls: list[int]):
    """A wait's test that finds nothing until its last call, making `polls[k]` calls of
    `len` in its k-th call (the last one's extra calls are its work)."""
    calls = iter(polls)

    def test() -> bool:
        n = next(calls)
        for _ in range(n):
            len(())
        return n == polls[-1]

    return test


def _wait(done) -> None:  # the engine's wait, in small: poll `done` until it is true
    while not done():
        pass


def _agree(test) -> None:  # a part of the engine that waits
    len(())
    _wait(test)


def test_the_call_counter_counts_the_work_in_a_wait_but_not_its_polling():
    counter = CallCounter(wait=_wait, parts={_agree: "agreement"})
    # Two tests found nothing (2 calls each), one did work but not enough to end the wait
    # (2 + 3), the last ended it (2 + 5): 3 + 5 calls of work, whatever the polling was.
    for polls in ([2, 2, 5, 7], [2, 5, 2, 2, 2, 2, 7]):
        test = _test(polls)
        counted = counter.count(lambda test=test: _agree(test))
        # _agree and its len: 2; the test that ended the wait (its call, next, 7 lens): 9;
        # the work beyond polling in the others (a poll being the 4 calls of the cheapest
        # test): 3. The lambda is called outside every part: the rest's one call.
        assert counted["agreement"] == 2 + 9 + 3, (polls, counted)
        assert counted["rest"] == 1, counted
