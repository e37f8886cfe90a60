"""What a rank pays per cycle as the job grows: the engine's own counts on 2, 3, 5 and 8
ranks (oversubscribed), and the small allreduces of recursive doubling against numpy.

One job per world size runs every scenario (tests/workers/scale.py): a training-like step
of 8 named 4 KiB allreduces, a lone synchronous 4 KiB allreduce, allreduces that take
recursive doubling, and a mismatch.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from launch import run_ringrun
from ringplug.bench.scale import build_profiler  # the bench builds the same library

pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "scale.py")
STEPS = 5  # the worker's measured steps
NEGOTIATION_TAGS = (7100, 7101)  # engine/exchange.py: CONTROL_TAG, GATHER_TAG
# The stall is named after 2 s and ends the collectives after 8 (no other wait of the job
# comes near that, even oversubscribed).
STALL_SETTINGS = {"RINGPLUG_STALL_CHECK_SECONDS": "2", "RINGPLUG_STALL_SHUTDOWN_SECONDS": "8"}
SIZES = [2, 3, 5, 8]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """size -> every rank's report (one job per size, run once for the module), with the
    sends an MPI profiling library counted in the measured steps when it could be built
    ("pmpi": tag -> [messages, bytes]; "pmpi_missing": why not)."""
    library, why = build_profiler(tmp_path_factory.mktemp("pmpi"))
    found = {}
    for size in SIZES:
        outdir = tmp_path_factory.mktemp(f"scale-{size}")
        preload = []
        if library is not None:
            preload = ["env", f"LD_PRELOAD={library}", f"PMPI_COUNT_DIR={outdir}"]
        # At 8 ranks (where a cycle agrees before it gathers) the job ends in a stall.
        stall = ["--stall"] if size == 8 else []
        result = run_ringrun(
            "-np",
            str(size),
            *preload,
            sys.executable,
            WORKER,
            str(outdir),
            *stall,
            extra_env=STALL_SETTINGS if stall else {},
            timeout=240,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        found[size] = []
        for rank in range(size):
            report = json.loads((outdir / f"scale-{rank}.json").read_text())
            if library is None:
                report["pmpi_missing"] = why
            else:
                lines = (outdir / f"sends-{rank}.txt").read_text().split("\n")
                report["pmpi"] = {
                    int(tag): [int(m), int(b)]
                    for tag, m, b in (line.split() for line in lines if line)
                }
            found[size].append(report)
    return found


@pytest.mark.parametrize("size", SIZES)
def test_an_agreed_cycle_costs_each_rank_ceil_log2_p_negotiation_messages(reports, size):
    rounds = math.ceil(math.log2(size))
    for report in reports[size]:
        assert report["ok"]
        for scenario in ("step", "lone"):
            counts = report[scenario]
            assert counts["cycles"] >= 1
            # Up to 7 ranks every cycle gathers the messages in the rounds; from 8 a cycle
            # first agrees on their form in the rounds, and gathers only when they differ
            # (under load, a cycle may start before every rank submitted the whole step).
            passes = 2 * counts["cycles"] - counts["agreed"] if size >= 8 else counts["cycles"]
            assert counts["messages"]["negotiation"] == pytest.approx(rounds * passes)
            assert counts["messages"]["negotiation"] <= 2 * rounds * counts["cycles"]
            # Nothing else is sent point to point: the allreduces are MPI's own or carried.
            assert set(counts["messages"]) == {"negotiation"}


def test_messages_per_cycle_grow_with_log_p_not_p(reports):
    # p - 1 per cycle (every peer) was the all-to-all this replaced: 7 at 8 ranks.
    per_pass = {}
    for size in SIZES:
        step = reports[size][0]["step"]
        passes = 2 * step["cycles"] - step["agreed"] if size >= 8 else step["cycles"]
        per_pass[size] = step["messages"]["negotiation"] / passes
    assert per_pass == {2: 1, 3: 2, 5: 3, 8: 3}
    # At 8 ranks some of the 10 measured cycles were agreed without a gather (a repeated
    # step: every rank had the same requests ready).
    assert reports[8][0]["step"]["agreed"] + reports[8][0]["lone"]["agreed"] > 0


@pytest.mark.parametrize("size", SIZES)
def test_a_small_allreduce_sends_at_most_2n_ceil_log2_p_bytes(reports, size):
    n = 4096
    for report in reports[size]:
        sent = report["lone"]["bytes"]["negotiation"]
        # Up to 7 ranks the data rides in the negotiation ((p - 1) n bytes); beyond it is
        # MPI's own allreduce, and the messages are a few bytes of form per rank.
        assert sent <= 2 * n * math.ceil(math.log2(size)) + 64 * size
        if size == 8:
            # The ranks agree that every message has one form: a few bytes per round.
            assert sent <= 64 * math.ceil(math.log2(size))
            assert report["lone"]["collectives"] == {"Iallreduce": 1.0}


@pytest.mark.parametrize("size", SIZES)
def test_recursive_doubling_matches_numpy_bit_for_bit_on_every_rank(reports, size):
    for report in reports[size]:
        bad = {name: case for name, case in report["doubling"].items() if not case["ok"]}
        assert bad == {}
        paths = {name: case["path"] for name, case in report["doubling"].items()}
        # 16-bit floats, and Max and Min of floats: MPI cannot reduce them (NaN kept).
        assert paths["float16/sum/7"] == paths["bfloat16/max/1000"] == "doubling"
        assert paths["float32/max/7"] == "doubling"
        assert paths["float32/sum/7"] == "mpi"
        assert paths["reducescatter/float16/sum"] == paths["reducescatter/float16/max"]
        assert paths["reducescatter/float16/sum"] == "doubling"
    assert len({report["digest"] for report in reports[size]}) == 1


@pytest.mark.parametrize("size", SIZES)
def test_a_mismatch_raises_on_every_rank_naming_the_tensor(reports, size):
    for report in reports[size]:
        assert report["mismatch"].startswith("MismatchError: 'differs' does not match across")
        assert "shape (3,)" in report["mismatch"] and "shape (4,)" in report["mismatch"]


@pytest.mark.parametrize("size", SIZES)
def test_the_engines_counts_are_what_an_mpi_profiling_library_counts(reports, size):
    for report in reports[size]:
        if "pmpi_missing" in report:
            pytest.skip(report["pmpi_missing"])
        step = report["step"]
        counted = [report["pmpi"].get(tag, [0, 0]) for tag in NEGOTIATION_TAGS]
        assert sum(m for m, _ in counted) == step["messages"]["negotiation"] * STEPS
        assert sum(b for _, b in counted) == step["bytes"]["negotiation"] * STEPS
        # Nothing else was sent point to point in those steps.
        assert set(report["pmpi"]) <= set(NEGOTIATION_TAGS)


@pytest.mark.parametrize("size", SIZES)
def test_joined_ranks_add_nothing_and_everyone_learns_the_last_to_join(reports, size):
    last = max(rank for rank in range(size) if rank % 3 == 2) if size > 2 else size - 1
    for rank, report in enumerate(reports[size]):
        joined = report["join"]
        # Batch b is summed over the ranks that have it: those with more than b batches.
        expected = [[float(sum(1 for r in range(size) if r % 3 >= b))] * 2 for b in range(3)]
        assert joined["sums"] == expected[: rank % 3 + 1]
        assert joined["last"] == last
        assert joined["after"] == [float(size)] * 2


def test_the_stall_inspector_names_who_lacks_what_when_ranks_agree_before_gathering(reports):
    reports_8 = reports[8]
    for report in reports_8:
        stall = report["stall"]
        assert stall["type"] == "StallError", stall
        assert (
            "'everyone-but-the-last' is ready on rank(s) 0, 1, 2, 3, 4, 5, 6 but not on rank(s) 7"
            in stall["error"]
        )
        assert "rank 7 waits in a different collective ('only-the-last')" in stall["error"]
