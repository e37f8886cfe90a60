"""The step-time breakdown and its verdict: the rules on planted medians (one process), and
on 2 real ranks with planted bottlenecks, in Lightning and in Keras, and on 3 real ranks of
a 2-parameter model; stall reports that say what the missing rank was doing."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun
from ringplug import diagnose
from ringplug.config import diagnose_setting
from ringplug.core import activity
from ringplug.core.timeline import Timeline
from ringplug.diagnose import RankSummary, summarize, verdict

WORKERS = Path(__file__).parent / "workers"
SCENARIOS = ["data", "straggler", "communication", "compute"]
EXPECTED = {
    "data": ("data-bound", 1),
    "straggler": ("straggler", 1),
    "communication": ("communication-bound", None),
    "compute": ("compute-bound", None),
}


def ms(
    rank: int,
    step: float,
    data: float = 0.0,
    compute: float = 0.0,
    communication: float = 0.0,
    optimizer: float = 0.0,
    nbytes: float = 0.0,
    window: float = 0.0,
    collectives: float = 0.0,
    reductions: float = 0.0,
) -> RankSummary:
    """A rank's medians, given in milliseconds (and counts per step)."""
    other = step - data - compute - communication - optimizer
    return RankSummary(
        rank,
        "host",
        20,
        step / 1e3,
        data / 1e3,
        compute / 1e3,
        communication / 1e3,
        optimizer / 1e3,
        other / 1e3,
        nbytes,
        window / 1e3,
        (step - communication) / 1e3,
        collectives,
        reductions,
    )


# ---------------------------------------------------------------------- the rules
def test_a_rank_waiting_for_its_own_data_is_named_data_bound():
    ranks = [ms(0, 50, data=1, compute=8, communication=40), ms(1, 50, data=40, compute=8)]
    found = verdict(ranks)
    assert (found.kind, found.rank) == ("data-bound", 1)
    assert "rank 1 waits 80% of each step for data" in found.text
    assert "num_workers" in found.text


def test_a_rank_computing_far_longer_than_the_others_is_the_straggler():
    ranks = [
        ms(0, 50, compute=10, communication=38),
        ms(1, 50, compute=45, communication=3),
        ms(2, 50, compute=11, communication=37),
    ]
    found = verdict(ranks)
    assert (found.kind, found.rank) == ("straggler", 1)
    assert "rank 1 computes 4.3x as long as the median of the others" in found.text


def test_a_mild_straggler_is_quoted_in_percent():
    ranks = [ms(0, 50, compute=30, communication=15), ms(1, 50, compute=42, communication=3)]
    assert "computes 40% slower than the median" in verdict(ranks).text


def test_every_rank_waiting_for_the_reduction_is_communication_bound_with_its_bandwidth():
    mib = 32 * 2**20
    ranks = [
        ms(0, 100, compute=20, communication=60, nbytes=mib, window=65),
        ms(1, 100, compute=21, communication=58, nbytes=mib, window=64),
    ]
    found = verdict(ranks, ceiling_busbw=4e9)
    assert found.kind == "communication-bound"
    assert "every rank waits 58% or more" in found.text
    assert "32.0 MiB per step" in found.text
    # 2 ranks move 2 * (2-1)/2 * 32 MiB per allreduce, in the median window of 64.5 ms.
    assert f"{mib / 0.0645 / 1e9:.2f} GB/s bus bandwidth" in found.text
    assert "against 4.00 GB/s by ringrun --check --bench" in found.text
    assert "the link can do more" in found.text


def test_without_a_measured_ceiling_the_verdict_says_how_to_measure_one():
    ranks = [ms(0, 100, compute=20, communication=60, nbytes=1e6, window=60)] * 2
    assert "ringrun --check --bench" in verdict(ranks).text


def test_large_gradients_far_below_a_fast_measured_link_stay_communication_bound():
    # 32 MiB at a measured 20 GB/s would take 1.7 ms of the 60 ms wait: the link is going
    # far slower than it can, but an allreduce this large is about bytes, not round trips.
    mib = 32 * 2**20
    ranks = [
        ms(r, 100, compute=30, communication=60, nbytes=mib, window=60, collectives=2, reductions=2)
        for r in range(2)
    ]
    found = verdict(ranks, ceiling_busbw=20e9)
    assert found.kind == "communication-bound"
    assert "the link can do more" in found.text
    assert "compression='fp16'" in found.text


def test_a_two_parameter_model_waiting_on_round_trips_is_latency_bound():
    # The medians of a real 3-rank Lightning fit of Linear(1, 1) on 2 cores: 8 bytes of
    # gradients, yet 43% or more of every step in the reduction. Bandwidth has nothing to
    # do with it, so neither do fp16 or a faster interconnect.
    ranks = [
        ms(
            0,
            14.7,
            data=0.3,
            compute=2.9,
            communication=6.3,
            optimizer=0.4,
            nbytes=8,
            window=6.5,
            collectives=2,
            reductions=1,
        ),
        ms(
            1,
            14.0,
            data=0.3,
            compute=1.6,
            communication=7.2,
            optimizer=0.4,
            nbytes=8,
            window=7.4,
            collectives=2,
            reductions=1,
        ),
        ms(
            2,
            12.5,
            data=0.3,
            compute=1.8,
            communication=6.4,
            optimizer=0.4,
            nbytes=8,
            window=6.6,
            collectives=2,
            reductions=1,
        ),
    ]
    found = verdict(ranks)
    assert (found.kind, found.rank) == ("latency-bound", None)
    assert "communication-bound" not in found.text and "GB/s bus bandwidth" not in found.text
    assert "compression" not in found.text and "interconnect" not in found.text
    assert "every rank waits 43% or more" in found.text
    assert "only 8 B per step" in found.text
    assert "(1 gradient allreduce per step, 6.30 ms; 2 collectives per step in all" in found.text
    assert "more processes than cores" in found.text  # 6.3 ms is no network's round trip
    assert "backward_passes_per_step" in found.text and "sync_dist" in found.text
    assert "RINGPLUG_FUSION_THRESHOLD" not in found.text  # one allreduce: nothing to fuse
    assert "ringrun --check --bench -np N measures yours" in found.text


def test_many_small_allreduces_are_told_to_fuse():
    ranks = [
        ms(
            r,
            10,
            compute=5,
            communication=4,
            nbytes=4000,
            window=4.5,
            collectives=30,
            reductions=30,
        )
        for r in range(2)
    ]
    found = verdict(ranks)
    assert found.kind == "latency-bound"
    assert "30 gradient allreduces per step, 0.13 ms each" in found.text
    assert "RINGPLUG_FUSION_THRESHOLD" in found.text and "bucket_bytes" in found.text
    assert "sync_dist" not in found.text  # no collectives besides the gradients'
    assert "more processes than cores" not in found.text


@pytest.mark.parametrize(
    ("nbytes", "ceiling", "kind"),
    [
        # No ceiling: a 0.1 GB/s link moves 5,000 bytes in one 50 us round trip (2 ranks
        # send each byte once on the bus).
        (4_000, None, "latency-bound"),
        (6_000, None, "communication-bound"),
        # At a measured 6 GB/s, a round trip's worth is 300,000 bytes.
        (250_000, 6e9, "latency-bound"),
        (350_000, 6e9, "communication-bound"),
    ],
)
def test_bandwidth_is_named_once_the_bytes_outlast_a_round_trip(nbytes, ceiling, kind):
    ranks = [
        ms(
            r,
            100,
            compute=30,
            communication=60,
            nbytes=nbytes,
            window=60,
            collectives=1,
            reductions=1,
        )
        for r in range(2)
    ]
    assert verdict(ranks, ceiling_busbw=ceiling).kind == kind


@pytest.mark.parametrize(
    ("nbytes", "kind"), [(20_000, "latency-bound"), (40_000, "communication-bound")]
)
def test_bytes_that_fill_a_quarter_of_a_short_wait_are_named(nbytes, kind):
    # 10 allreduces' round trips (0.5 ms) are more than either payload needs at 0.1 GB/s,
    # but 40 KB take 0.4 ms of the 1.2 ms wait, and 20 KB only 0.2 ms.
    ranks = [
        ms(
            r,
            4,
            compute=2,
            communication=1.2,
            nbytes=nbytes,
            window=1.2,
            collectives=10,
            reductions=10,
        )
        for r in range(2)
    ]
    assert verdict(ranks).kind == kind


def test_a_rank_late_with_other_work_is_named_though_it_computes_no_longer():
    # Rank 2 computes 20% longer (no straggler), but spends 11 ms more on the rest of its
    # step; ranks 0 and 1 wait for it in the reduction.
    ranks = [
        ms(0, 30, compute=5, communication=14),
        ms(1, 30, compute=5, communication=14),
        ms(2, 30, compute=6, communication=2),
    ]
    found = verdict(ranks)
    assert (found.kind, found.rank) == ("late rank", 2)
    assert "rank 2 reaches the gradient reduction last, 12.0 ms after the others" in found.text
    assert "most of the difference in the rest of the step: 22.0 against 11.0 ms" in found.text
    assert "ranks 0, 1 wait 12.0 ms longer than it does (40% of each step)" in found.text
    assert "logging, callbacks" in found.text
    assert "communication-bound" not in found.text


def test_a_rank_computing_a_little_longer_is_late_before_it_is_a_straggler():
    # 25 against 20 ms: under STRAGGLER_RATIO, but rank 0 waits 15% of each step for it.
    ranks = [ms(0, 40, compute=20, communication=10), ms(1, 40, compute=25, communication=4)]
    found = verdict(ranks)
    assert (found.kind, found.rank) == ("late rank", 1)
    assert "most of the difference in forward and backward: 25.0 against 20.0 ms" in found.text
    assert "rank 1 reaches the gradient reduction last, 6.0 ms after the others" in found.text
    assert "rank 0 waits 6.0 ms longer than it does (15% of each step)" in found.text


def test_a_late_rank_costing_more_than_the_reduction_is_named_first():
    # Every rank waits at least 30% (rank 2 too), but ranks 0 and 1 wait 40 ms more for it.
    ranks = [
        ms(0, 100, compute=20, communication=70, nbytes=8),
        ms(1, 100, compute=20, communication=70, nbytes=8),
        ms(2, 100, compute=20, communication=30, nbytes=8),
    ]
    assert (verdict(ranks).kind, verdict(ranks).rank) == ("late rank", 2)
    # With the lateness smaller than what every rank waits, the reduction comes first.
    ranks[2] = ms(2, 100, compute=20, communication=55, nbytes=8)
    assert verdict(ranks).kind == "latency-bound"


def test_waiting_behind_a_straggler_is_not_called_communication_bound():
    # Rank 0 waits most of its step, but rank 1 (the slow one) hardly waits at all.
    ranks = [ms(0, 50, compute=10, communication=38), ms(1, 50, compute=45, communication=2)]
    assert verdict(ranks).kind == "straggler"


def test_busy_ranks_with_small_waits_are_compute_bound():
    ranks = [
        ms(0, 50, compute=40, communication=5, optimizer=2),
        ms(1, 50, compute=42, communication=4, optimizer=2),
    ]
    found = verdict(ranks)
    assert found.kind == "compute-bound"
    assert "nothing to fix in distribution" in found.text


def test_medians_leave_out_the_first_step_and_split_each_step_into_phases():
    # (start, data_start, data, arrived, backward_end, reduce_start, reduced, end, nbytes,
    #  collectives, reductions)
    warmup = (0.0, 0.0, 0.5, 1.0, 2.0, 1.5, 3.0, 4.0, 100, 9, 9)
    rows = [warmup] + [
        (t, t, 0.001, t + 0.002, t + 0.010, t + 0.006, t + 0.013, t + 0.015, 100, 3, 2)
        for t in (10.0, 20.0, 30.0)
    ]
    summary = summarize(rows, rank=3, host="h")
    assert summary.steps == 3
    assert summary.step == pytest.approx(0.015)
    assert summary.data == pytest.approx(0.001)
    assert summary.compute == pytest.approx(0.008)
    assert summary.communication == pytest.approx(0.003)
    assert summary.optimizer == pytest.approx(0.002)
    assert summary.window == pytest.approx(0.007)
    assert summary.bytes_per_step == 100
    assert summary.own_time == pytest.approx(0.012)  # the step less its 3 ms reduction wait
    assert (summary.collectives, summary.reductions) == (3, 2)


def test_the_clock_counts_the_engines_collectives_and_the_optimizers_allreduces(monkeypatch):
    class Engine:
        collectives_run = 0

    engine = Engine()
    monkeypatch.setattr("ringplug.core.runtime.current_engine", lambda: engine)
    monkeypatch.setattr(diagnose, "_active", None)  # start() makes the clock the active one
    clock = diagnose.StepClock(trace=False)
    clock.start()
    for t in (1.0, 2.0):  # two steps, each: 2 buckets, 3 collectives in all
        clock.arrived(t)
        clock.reduction_started(t + 0.1)
        clock.reduction_started(t + 0.2)
        clock.backward_ended(t + 0.3)
        engine.collectives_run += 3
        clock.reduced(t + 0.4, 64)
        clock.step_ended(t + 0.5)
    engine.collectives_run += 5  # between the phases (a validation loop): the next step's
    clock.arrived(3.0)
    clock.backward_ended(3.3)  # Keras: only backward's end and the reduction's
    engine.collectives_run += 1
    clock.reduced(3.4, 64)
    clock.step_ended(3.5)
    assert [row[9:] for row in clock.recent(3)] == [(3, 2), (3, 2), (6, 1)]


def test_the_table_has_a_row_per_rank_and_the_verdict_line():
    ranks = [ms(0, 50, data=1, compute=8, communication=40), ms(1, 50, data=40, compute=8)]
    found = diagnose.Diagnosis(ranks, verdict(ranks), None, final=True)
    lines = found.table().splitlines()
    assert lines[0].startswith("ringplug step-time breakdown (end of fit, medians over 20")
    assert lines[1].split() == [
        "rank",
        "host",
        "step",
        "data",
        "compute",
        "comm",
        "optim",
        "other",
        "MiB/step",
    ]
    assert lines[3].split()[:4] == ["1", "host", "50.00", "40.00"]
    assert lines[-1].startswith("verdict: data-bound: rank 1")
    metrics = found.metrics()
    assert metrics["ringplug/rank1/data_ms"] == pytest.approx(40.0)
    assert metrics["ringplug/rank1/data_share"] == pytest.approx(0.8)


def test_the_diagnose_variables_are_read_and_bad_values_refused(monkeypatch):
    monkeypatch.setenv("RINGPLUG_DIAGNOSE", "0")
    monkeypatch.setenv("RINGPLUG_DIAGNOSE_EVERY", "50")
    assert diagnose_setting() == (False, 50)
    monkeypatch.setenv("RINGPLUG_DIAGNOSE", "maybe")
    with pytest.raises(ValueError, match="RINGPLUG_DIAGNOSE='maybe': use 1"):
        diagnose_setting()
    monkeypatch.setenv("RINGPLUG_DIAGNOSE", "1")
    monkeypatch.setenv("RINGPLUG_DIAGNOSE_EVERY", "0")
    with pytest.raises(
        ValueError, match="RINGPLUG_DIAGNOSE_EVERY=.0. must be a whole number of at least 1"
    ):
        diagnose_setting()


def test_a_missing_rank_is_described_by_its_phase_or_the_collective_it_waits_in():
    activities = [("", 0.0), (activity.WAITING_FOR_DATA, 12.4), (activity.COMPUTING, 3.0)]
    partial = {"grads": [0], "other": [2]}
    text = activity.describe([1, 2], activities, partial)
    assert text == (
        "rank 1 was waiting for data for 12 s; rank 2 waits in a different "
        "collective ('other'; last phase: in forward/backward)"
    )
    assert activity.describe([0], activities, {"other": [2]}) == ""  # rank 0 named no phase


def test_timeline_tracks_give_each_rank_its_own_process(tmp_path):
    path = tmp_path / "trace.json"
    timeline = Timeline(str(path), rank=0)
    timeline.track(1, "data", 1.0, 1.5)
    timeline.track(0, "compute", 1.0, 1.2)
    timeline.stop()
    events = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[1001] == "rank 1 training steps" and names[1000] == "rank 0 training steps"
    data = [e for e in events if e["name"] == "data"]
    assert data[0]["pid"] == 1001 and data[0]["dur"] == pytest.approx(5e5)


# ---------------------------------------------------------------------- 2 real ranks
def _reports(outdir: Path) -> dict[str, list[dict]]:
    return {
        s: [json.loads((outdir / f"{s}-{r}.json").read_text()) for r in range(2)] for s in SCENARIOS
    }


# The planted communication bottleneck is a 32 MiB gradient per step; reduced in 8 KiB ring
# segments it stands in for a slow link. At the ring's full speed its reduction took about
# as long as the dense embedding gradient's own compute here, 27-48% of a step, so the
# verdict turned on the machine's load. The other scenarios' gradients are a few KiB.
SLOW_LINK = {"RINGPLUG_RING_SEGMENT": "8K"}


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory) -> dict:
    pytest.importorskip("lightning")
    outdir = tmp_path_factory.mktemp("diagnose-lightning")
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        str(WORKERS / "diagnose_lightning.py"),
        str(outdir),
        *SCENARIOS,
        extra_env={"RINGPLUG_TIMEOUT": "60", **SLOW_LINK},
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {"reports": _reports(outdir), "outdir": outdir, "stdout": result.stdout}


@pytest.fixture(scope="module", params=["tensorflow", "torch"])
def keras_run(request, tmp_path_factory) -> dict:
    pytest.importorskip("keras")
    pytest.importorskip(request.param)
    outdir = tmp_path_factory.mktemp(f"diagnose-keras-{request.param}")
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        str(WORKERS / "diagnose_keras.py"),
        str(outdir),
        *SCENARIOS,
        extra_env={
            "KERAS_BACKEND": request.param,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "RINGPLUG_TIMEOUT": "60",
            **SLOW_LINK,
        },
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {"reports": _reports(outdir), "outdir": outdir, "stdout": result.stdout}


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lightning_verdict_names_the_planted_bottleneck(lightning_run, scenario):
    reports = lightning_run["reports"][scenario]
    kind, rank = EXPECTED[scenario]
    assert [r["verdict"]["kind"] for r in reports] == [kind, kind], reports[0]["table"]
    assert reports[0]["verdict"]["rank"] == rank, reports[0]["table"]
    assert reports[0]["table"] == reports[1]["table"]  # every rank got the same diagnosis


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_keras_verdict_names_the_planted_bottleneck(keras_run, scenario):
    reports = keras_run["reports"][scenario]
    kind, rank = EXPECTED[scenario]
    assert [r["verdict"]["kind"] for r in reports] == [kind, kind], reports[0]["table"]
    assert reports[0]["verdict"]["rank"] == rank, reports[0]["table"]


@pytest.mark.multirank
def test_rank_zero_prints_the_table_once_per_fit(lightning_run):
    printed = [
        line
        for line in lightning_run["stdout"].splitlines()
        if "ringplug step-time breakdown" in line
    ]
    assert len(printed) == len(SCENARIOS)
    assert all(line.startswith("[0]") for line in printed)


@pytest.mark.multirank
def test_lightning_loggers_get_every_ranks_phases(lightning_run):
    (metrics,) = (lightning_run["outdir"] / "data").glob("version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    shares = [float(r["ringplug/rank1/data_share"]) for r in rows if r["ringplug/rank1/data_share"]]
    assert shares and shares[-1] >= diagnose.DATA_SHARE
    assert "ringplug/rank0/communication_ms" in rows[0]


@pytest.mark.multirank
def test_the_timeline_shows_each_ranks_steps_on_its_own_track(lightning_run):
    events = json.loads((lightning_run["outdir"] / "timeline.json").read_text())
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert tracks[1000] == "rank 0 training steps" and tracks[1001] == "rank 1 training steps"
    rank1_data = [e for e in events if e["pid"] == 1001 and e["name"] == "data"]
    # Rank 1's loader sleeps 40 ms per batch: its data spans show it.
    assert len(rank1_data) >= 10 and min(e["dur"] for e in rank1_data) >= 40e3


@pytest.mark.multirank
def test_keras_epoch_logs_reach_the_csv_logger(keras_run):
    with (keras_run["outdir"] / "data-0.csv").open() as file:
        (row,) = list(csv.DictReader(file))
    assert float(row["ringplug_rank1_data_share"]) >= diagnose.DATA_SHARE
    assert "ringplug_rank0_compute_ms" in row


@pytest.mark.multirank
def test_a_two_parameter_model_on_3_ranks_is_not_called_communication_bound(tmp_path):
    pytest.importorskip("lightning")
    result = run_ringrun(
        "-np",
        "3",
        sys.executable,
        str(WORKERS / "diagnose_lightning.py"),
        str(tmp_path),
        "tiny",
        extra_env={"RINGPLUG_TIMEOUT": "60"},
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads((tmp_path / f"tiny-{r}.json").read_text()) for r in range(3)]
    table = reports[0]["table"]
    # Whatever held these steps up (round trips, a rank the 2 cores ran late, compute), it
    # was not 8 bytes of gradients.
    kinds = {r["verdict"]["kind"] for r in reports}
    assert len(kinds) == 1 and "communication-bound" not in kinds, table
    assert "compression='fp16'" not in reports[0]["verdict"]["text"], table
    for rank in reports[0]["ranks"]:
        assert rank["bytes_per_step"] == 8, table  # Linear(1, 1): 2 float32 gradients
        assert rank["reductions"] == 1, table  # one bucket
        assert rank["collectives"] >= 1, table


@pytest.mark.multirank
def test_stall_warnings_say_what_the_missing_rank_was_doing():
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        str(WORKERS / "diagnose_stall.py"),
        extra_env={"RINGPLUG_STALL_CHECK_SECONDS": "0.5", "RINGPLUG_TIMEOUT": "60"},
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = {
        line.split("Stalled collectives: ")[1].split(" is ready")[0]: line
        for line in result.stderr.splitlines() + result.stdout.splitlines()
        if "Stalled collectives: " in line
    }
    assert "rank 1 was waiting for data for" in warnings["'stall.data.1'"]
    assert "rank 1 was in forward/backward for" in warnings["'stall.compute'"]
    assert "rank 1 waits in a different collective ('stall.other'" in warnings["'stall.different'"]
    assert "rank 1 was done with its data for" in warnings["'stall.finished'"]


# ---------------------------------------------------------------------- measured ceiling
def test_a_measured_ceiling_is_found_again_for_the_same_ranks_and_hosts(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert diagnose.read_ceiling(2, ["a"]) is None
    diagnose.write_ceiling(2, ["b", "a"], 5e9)
    diagnose.write_ceiling(4, ["a", "b"], 3e9)
    diagnose.write_ceiling(2, ["a", "b"], 6e9)  # measured again: replaces the first
    assert diagnose.read_ceiling(2, ["a", "b"]) == 6e9
    assert diagnose.read_ceiling(4, ["a", "b"]) == 3e9
    assert diagnose.read_ceiling(2, ["a"]) is None
    assert len(json.loads((tmp_path / "ringplug" / "ceiling.json").read_text())) == 2


def test_bench_without_check_is_refused_with_the_right_usage():
    result = run_ringrun("--bench", "-np", "2", timeout=30)
    assert result.returncode == 2
    assert "--bench goes with --check: ringrun --check --bench -np N" in result.stderr


@pytest.mark.multirank
def test_check_bench_sweeps_allreduce_on_the_jobs_ranks_and_remembers_the_peak(tmp_path):
    result = run_ringrun(
        "--check", "--bench", "-np", "2", extra_env={"XDG_CACHE_HOME": str(tmp_path)}, timeout=120
    )
    assert "ringplug allreduce sweep: 2 ranks" in result.stdout, result.stdout + result.stderr
    rows = [
        line.split()
        for line in result.stdout.splitlines()
        if " MiB " in line and "peak" not in line and "sweep" not in line
    ]
    assert [row[1] for row in rows] == ["0.06", "1.00", "8.00", "32.00"]
    (entry,) = json.loads((tmp_path / "ringplug" / "ceiling.json").read_text())
    assert entry["ranks"] == 2 and len(entry["hosts"]) == 1
    best = max(float(row[-1]) for row in rows)  # the busbw column, as printed
    assert entry["busbw"] / 1e9 == pytest.approx(best, abs=0.006)
    assert f"peak bus bandwidth {entry['busbw'] / 1e9:.2f} GB/s" in result.stdout


def test_ring_strategy_refuses_a_diagnose_value_it_cannot_mean():
    pytest.importorskip("lightning")
    from ringplug.lightning.diagnostics import diagnostics_for

    for wrong in (0, -5, "yes", 2.5):
        with pytest.raises(ValueError, match="use True, False, None or a positive number"):
            diagnostics_for(wrong)
    assert diagnostics_for(False) is None
