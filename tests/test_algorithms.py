"""The algorithm table: its model fits and crossovers in one process, and on 2, 3, 4 and 5
ranks every algorithm of every kind against numpy and the calibration every rank agrees on
(one ringrun job per world size, tests/workers/algorithms.py)."""

from __future__ import annotations

import bisect
import json
import math
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun
from ringplug.config import Settings
from ringplug.core.algorithms import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    CACHED,
    CANDIDATES,
    HIERARCHICAL,
    MEASURED,
    OPTIONAL,
    REDUCESCATTER,
    SERIES,
    AlgorithmTable,
    Band,
    Model,
    bands_from_models,
    bands_from_points,
    cache_key,
    fit,
    fixed_table,
    load_cached,
    parse_forced,
    save_cached,
    table_from_models,
)
from ringplug.core.transport.hierarchical import spans_hosts, why_not
from ringplug.core.transport.host import Transport

WORKER = Path(__file__).parent / "workers" / "algorithms.py"


# ------------------------------------------------------------------------ in one process
def test_the_fit_recovers_alpha_and_beta_of_exact_points():
    points = [(n, 20e-6 + 0.5e-9 * n) for n in (4096, 65536, 524288, 4194304)]
    model = fit(points)
    assert model.alpha == pytest.approx(20e-6, rel=1e-6)
    assert model.beta == pytest.approx(0.5e-9, rel=1e-6)
    assert model.error < 1e-6


def test_the_fit_keeps_alpha_and_beta_from_going_negative():
    # Time falling with size would want a negative beta: the fit keeps it at 0.
    model = fit([(1000, 3e-3), (10_000, 2e-3), (100_000, 1e-3)])
    assert model.alpha > 0 and model.beta == 0.0
    assert model.error == pytest.approx(max(abs(model.alpha - t) / t for t in (3e-3, 2e-3, 1e-3)))


def test_bands_change_where_the_models_cross():
    # latency 10 us + 1 ns/B against 100 us + 0.1 ns/B: equal at 90e-6 / 0.9e-9 = 100,000 B.
    models = {"doubling": Model(10e-6, 1e-9), "ring": Model(100e-6, 0.1e-9)}
    assert bands_from_models(models) == ((0, "doubling"), (100_000, "ring"))


def test_an_algorithm_never_cheapest_gets_no_band():
    models = {
        "mpi": Model(5e-6, 0.3e-9),
        "doubling": Model(6e-6, 0.4e-9),  # above mpi at every size
        "ring": Model(50e-6, 0.1e-9),  # crosses mpi at 45e-6 / 0.2e-9 = 225,000 B
    }
    assert bands_from_models(models) == ((0, "mpi"), (225_000, "ring"))


KB4, KB64, KB512, MB4 = 4 << 10, 64 << 10, 512 << 10, 4 << 20


def test_a_crossover_lies_where_the_measured_points_cross_not_where_fitted_lines_do():
    # MPI's own allreduce on 2 ranks of the CI machine (us): its cost bends between 64 KiB
    # and 4 MiB (MPICH changes algorithm), so the line fitted to all four points crosses the
    # ring's far below where the measurements do.
    mpi = [(KB4, 5.6e-6), (KB64, 23.2e-6), (KB512, 84.7e-6), (MB4, 500.3e-6)]
    ring = [(KB4, 21.0e-6), (KB64, 50.4e-6), (KB512, 156.0e-6), (MB4, 453.9e-6)]
    models = {"mpi": fit(mpi), "ring": fit(ring)}
    # Between 512 KiB and 4 MiB each costs the line through its two points there.
    gap = (ring[2][1] - mpi[2][1]) / (
        (mpi[3][1] - mpi[2][1]) / (MB4 - KB512) - (ring[3][1] - ring[2][1]) / (MB4 - KB512)
    )
    assert bands_from_points(models) == ((0, "mpi"), (math.ceil(KB512 + gap), "ring"))
    assert 2 << 20 < KB512 + gap < 3 << 20
    (_, _), (fitted, _) = bands_from_models(models)
    assert fitted < 3 * (1 << 20) // 2  # where the lines cross: MPI was faster at 1 MiB
    table = table_from_models(
        2, {"allreduce/mpi": models["mpi"], "allreduce/ring": models["ring"], **_others()}, 1.0
    )
    assert [table.choose(ALLREDUCE, n) for n in (1 << 20, 2 << 20, MB4)] == ["mpi", "mpi", "ring"]


def test_below_the_smallest_measured_size_its_winner_holds():
    # Doubling's line through its 4 KiB and 64 KiB points starts below MPI's at 0 bytes;
    # nothing was measured there, so the 4 KiB winner (MPI) keeps the smallest sizes.
    mpi = [(KB4, 5.6e-6), (KB64, 23.2e-6)]
    doubling = [(KB4, 7.1e-6), (KB64, 53.3e-6)]
    models = {"mpi": fit(mpi), "doubling": fit(doubling)}
    assert bands_from_points(models) == ((0, "mpi"),)
    # A crossing between two measured sizes is a band; models without points are lines.
    ring = [(KB4, 40.0e-6), (KB64, 45.0e-6)]
    between = bands_from_points({"doubling": fit(doubling), "ring": fit(ring)})
    assert [name for _, name in between] == ["doubling", "ring"] and KB4 < between[1][0] < KB64
    lines = {"doubling": Model(10e-6, 1e-9), "ring": Model(100e-6, 0.1e-9)}
    assert (
        bands_from_points(lines) == bands_from_models(lines) == ((0, "doubling"), (100_000, "ring"))
    )


def test_every_size_goes_to_the_algorithm_its_measured_points_price_cheapest():
    # Models measured at different sizes, one that bends, one only a line: the bands and
    # `Model.cost` (the autotuner's prices) are one reading of the measurements.
    models = {
        "mpi": fit([(KB4, 5.6e-6), (KB64, 23.2e-6), (KB512, 84.7e-6), (MB4, 500.3e-6)]),
        "doubling": fit([(KB4, 7.1e-6), (32 << 10, 20.0e-6), (KB512, 200.0e-6)]),
        "ring": fit([(KB4, 21.0e-6), (KB64, 50.4e-6), (KB512, 156.0e-6), (MB4, 453.9e-6)]),
        "line": Model(60e-6, 0.2e-9),
    }
    bands = bands_from_points(models)
    starts = [start for start, _ in bands]
    names = list(models)
    sizes = sorted(
        {1, 1000, KB4, 5000, KB64 - 1, KB64, 300_000, KB512, 3 << 20, MB4, 64 << 20}
        | {start + d for start in starts[1:] for d in (-1, 0, 1)}
    )
    for nbytes in sizes:
        cheapest = min(names, key=lambda name: (models[name].cost(nbytes), names.index(name)))
        assert bands[bisect.bisect_right(starts, nbytes) - 1][1] == cheapest, nbytes
    assert {name for _, name in bands} >= {"mpi", "ring"}
    # Between two measured sizes the cost is the line through the points; outside, the
    # first point's time below and the last line above.
    mpi = models["mpi"]
    assert mpi.cost(KB64) == pytest.approx(23.2e-6)
    assert mpi.cost((KB64 + KB512) / 2) == pytest.approx((23.2e-6 + 84.7e-6) / 2)
    assert mpi.cost(100) == pytest.approx(5.6e-6)
    slope = (500.3e-6 - 84.7e-6) / (MB4 - KB512)
    assert mpi.cost(2 * MB4) == pytest.approx(500.3e-6 + slope * MB4)
    assert models["line"].cost(KB64) == models["line"].seconds(KB64)


def _others() -> dict[str, Model]:
    """The series a table needs beside allreduce's mpi and ring, measured at the same sizes
    and too dear to win anything."""
    dear = fit([(n, 1.0) for n in (KB4, KB64, KB512, MB4)])
    return {
        name: dear
        for name in (
            "allreduce/doubling",
            "reducescatter/ring",
            "allgather/mpi",
            "allgather/ring",
            "broadcast/mpi",
            "broadcast/chain",
        )
    }


def test_a_waiter_of_its_own_tests_and_yields_as_the_engines():
    # ringplug-bench algorithms times the algorithms on a transport of its own: with the
    # waiter's defaults a rank with a core of its own slept between MPI's tests, and a
    # 1 MiB Iallreduce took 507 us where the engine's took 170 (2 ranks).
    from ringplug.config import Settings
    from ringplug.core.transport.waiting import Waiter

    engines, own = Waiter(None, Settings(), 0, 2), Waiter(None, Settings(), 0, 2)
    engines.spin_with_a_core_each()
    assert (own.spin_seconds, own.pause) != (engines.spin_seconds, engines.pause)
    own.spin_like(engines)
    assert (own.spin_seconds, own.pause) == (engines.spin_seconds, engines.pause)


def test_choose_reads_the_band_of_the_size():
    table = fixed_table(4, 1 << 20)
    assert table.choose(ALLREDUCE, (1 << 20) - 1) == "mpi"
    assert table.choose(ALLREDUCE, 1 << 20) == "ring"
    assert table.choose(ALLREDUCE, 100, mpi_reduces=False) == "doubling"
    assert table.choose(REDUCESCATTER, 5 << 20, mpi_reduces=False) == "ring"
    assert table.choose(ALLGATHER, 1 << 30, mpi_reduces=False) == "mpi"
    assert table.choose(BROADCAST, 0) == "mpi"
    assert table.crossovers() == [
        (ALLREDUCE, True, 1 << 20, "mpi", "ring"),
        (ALLREDUCE, False, 1 << 20, "doubling", "ring"),
        (REDUCESCATTER, True, 1 << 20, "mpi", "ring"),
        (REDUCESCATTER, False, 1 << 20, "doubling", "ring"),
    ]


def test_forcing_keeps_mpi_away_from_what_mpi_cannot_reduce():
    table = fixed_table(3, 1 << 20).forcing(parse_forced("mpi"))
    assert table.choose(ALLREDUCE, 1 << 30) == "mpi"
    assert table.choose(ALLREDUCE, 10, mpi_reduces=False) == "doubling"  # its fixed band
    assert table.choose(BROADCAST, 1 << 30) == "mpi"


KIB, MIB = 1 << 10, 1 << 20


def test_a_band_below_a_crossover_moves_it_down():
    table = fixed_table(4, MIB).overriding(Band("ring", 256 * KIB, MIB))
    assert table.bands[(ALLREDUCE, True)] == ((0, "mpi"), (256 * KIB, "ring"))
    assert table.bands[(ALLREDUCE, False)] == ((0, "doubling"), (256 * KIB, "ring"))
    assert table.row_text() == "mpi<256K<ring"


def test_a_band_above_a_crossover_moves_it_up():
    table = fixed_table(4, MIB).overriding(Band("mpi", MIB, 4 * MIB))
    assert table.bands[(ALLREDUCE, True)] == ((0, "mpi"), (4 * MIB, "ring"))
    # MPI cannot reduce that row: it keeps its bands
    assert table.bands[(ALLREDUCE, False)] == ((0, "doubling"), (MIB, "ring"))


def test_a_band_inside_another_adds_two_crossovers_and_leaves_every_other_size():
    plain = fixed_table(4, MIB)
    table = plain.overriding(Band("doubling", 4 * MIB, 8 * MIB))
    assert table.row_text() == "mpi<1M<ring<4M<doubling<8M<ring"
    for nbytes in (0, 100, MIB - 1, MIB, 4 * MIB - 1, 8 * MIB, 1 << 30):
        assert table.choose(ALLREDUCE, nbytes) == plain.choose(ALLREDUCE, nbytes), nbytes
    assert table.choose(ALLREDUCE, 4 * MIB) == "doubling"
    assert table.choose(ALLREDUCE, 8 * MIB - 1) == "doubling"
    # other kinds are untouched
    assert table.bands[(REDUCESCATTER, True)] == plain.bands[(REDUCESCATTER, True)]
    assert table.crossovers()[:2] == [
        (ALLREDUCE, True, MIB, "mpi", "ring"),
        (ALLREDUCE, True, 4 * MIB, "ring", "doubling"),
    ]


def test_an_open_band_takes_every_larger_size_and_bands_stack():
    table = fixed_table(4, MIB).overriding(Band("doubling", 16 * MIB))
    assert table.bands[(ALLREDUCE, True)] == ((0, "mpi"), (MIB, "ring"), (16 * MIB, "doubling"))
    table = table.overriding(Band("ring", 64 * KIB, 128 * KIB))
    assert table.row_text() == "mpi<64K<ring<128K<mpi<1M<ring<16M<doubling"
    assert str(Band("doubling", 16 * MIB)) == "doubling@[16M,inf)"
    assert str(Band("ring", 100_000, 128 * KIB)) == "ring@[100000,128K)"


@pytest.mark.parametrize(
    "band, says",
    [
        (Band("ring", MIB, MIB), "no range; give 0 <= start < end"),
        (Band("ring", 2 * MIB, MIB), "no range"),
        (Band("ring", -1, MIB), "no range"),
        (Band("chain", 0, MIB), "allreduce has no algorithm 'chain'; use one of doubling"),
        (Band("ring", 0, MIB, kind="alltoall"), "'alltoall' is no collective kind"),
    ],
)
def test_a_bad_band_is_refused_saying_what_is_allowed(band, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        fixed_table(4, MIB).overriding(band)


def test_the_forced_setting_reads_names_and_pairs():
    assert parse_forced("allreduce=ring, broadcast=chain") == {
        "allreduce": "ring",
        "broadcast": "chain",
    }
    assert parse_forced("ring") == {k: "ring" for k in (ALLREDUCE, REDUCESCATTER, ALLGATHER)}
    assert parse_forced("") == {}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("tree", "'tree' is no algorithm"),
        ("allgather=doubling", "allgather has no algorithm 'doubling'"),
        ("gather=ring", "'gather' is no collective kind"),
    ],
)
def test_a_wrong_forced_setting_is_refused_saying_what_exists(text, says):
    with pytest.raises(ValueError, match=says):
        parse_forced(text)
    with pytest.raises(ValueError, match=says):  # at init, on every rank alike
        Transport(None, Settings(algorithm=text))


def test_a_table_survives_json_and_the_cache(tmp_path):
    models = {
        name: Model(1e-5 * (i + 1), 1e-10 * (8 - i)) for i, name in enumerate(set(SERIES.values()))
    }
    from ringplug.core.algorithms import table_from_models

    table = table_from_models(3, models, 0.5)
    assert AlgorithmTable.from_json(table.to_json()) == table
    key = cache_key(["a", "a", "b"], "MPICH Version: 4.1", "0.1.0")
    save_cached(tmp_path, key, table)
    loaded = load_cached(tmp_path, key, 3)
    assert loaded is not None and loaded.source == CACHED and loaded.bands == table.bands
    assert load_cached(tmp_path, key, 4) is None  # another rank count
    assert load_cached(tmp_path, "absent", 3) is None
    (tmp_path / f"{key}.json").write_text("{not json")
    assert load_cached(tmp_path, key, 3) is None  # unreadable: measured again


def test_the_cache_key_tells_hosts_placement_and_libraries_apart():
    base = cache_key(["a", "b"], "MPICH 4.1", "0.1.0")
    assert (
        len(
            {
                base,
                cache_key(["a", "a"], "MPICH 4.1", "0.1.0"),
                cache_key(["b", "a"], "MPICH 4.1", "0.1.0"),
                cache_key(["a", "b", "b"], "MPICH 4.1", "0.1.0"),
                cache_key(["a", "b"], "Open MPI 5.0", "0.1.0"),
                cache_key(["a", "b"], "MPICH 4.1", "0.2.0"),
            }
        )
        == 6
    )


def test_json_that_names_an_unknown_algorithm_is_refused():
    text = fixed_table(2, 1024).to_json().replace('"mpi"', '"tree"')
    with pytest.raises(ValueError, match="not an algorithm table"):
        AlgorithmTable.from_json(text)


# --------------------------------------------------------------------------- on the ranks
@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """``reports(ranks)``: each rank's report of the job on `ranks` ranks (run once)."""
    jobs: dict[int, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def read(ranks: int) -> tuple[list[dict], Path]:
        if ranks not in jobs:
            outdir = tmp_path_factory.mktemp(f"algorithms-{ranks}")
            result = run_ringrun(
                "-np",
                str(ranks),
                sys.executable,
                str(WORKER),
                str(outdir),
                extra_env={
                    "RINGPLUG_CALIBRATION": "fresh",
                    "RINGPLUG_CALIBRATION_SECONDS": "30",
                    "XDG_CACHE_HOME": str(outdir / "cache"),
                    # No data carried in the negotiation: every allreduce takes its algorithm.
                    "RINGPLUG_EAGER_THRESHOLD": "0",
                    # Small segments: the ring's and the chain's segment loops run.
                    "RINGPLUG_RING_SEGMENT": "16K",
                },
                timeout=300,
            )
            jobs[ranks] = (result, outdir)
        result, outdir = jobs[ranks]
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        found = [json.loads((outdir / f"algorithms-{r}.json").read_text()) for r in range(ranks)]
        return found, outdir

    return read


RANKS = [2, 3, 4, 5]


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", RANKS)
def test_every_algorithm_of_every_kind_matches_numpy(reports, ranks):
    found, _ = reports(ranks)
    for rank, report in enumerate(found):
        bad = {n: c["detail"] for n, c in report["cases"].items() if not c["ok"]}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", RANKS)
def test_each_forced_algorithm_is_the_one_that_ran(reports, ranks):
    cases = reports(ranks)[0][0]["cases"]
    for name, case in cases.items():
        if name.startswith("process-set/"):
            continue
        kind, forced, dtype, op = (name.split("/") + [""])[:4]
        if kind in (ALLREDUCE, REDUCESCATTER) and (
            dtype == "float16" or (dtype.startswith("float") and op in ("MAX", "MIN"))
        ):
            # MPI cannot reduce these: a forced MPI stays on doubling.
            assert case["path"] == ("doubling" if forced == "mpi" else forced), name
        else:
            assert case["path"] == forced, name
    kinds = {tuple(name.split("/")[:2]) for name in cases if not name.startswith("process-set/")}
    # The hierarchical allreduce needs several hosts: test_hierarchical_* and test_multihost.
    assert kinds == {
        (k, a) for (k, _), names in CANDIDATES.items() for a in names if a not in OPTIONAL
    }


def the_table_every_rank_got(found: list[dict], key: str) -> AlgorithmTable:
    """The table the ranks' reports hold under `key`: one, the same on every rank."""
    tables = {report[key] for report in found}
    assert len(tables) == 1, tables
    return AlgorithmTable.from_json(tables.pop())


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", RANKS)
def test_every_rank_gets_the_same_measured_table(reports, ranks):
    found, _ = reports(ranks)
    table = the_table_every_rank_got(found, "table")
    assert table.source == MEASURED and table.size == ranks
    # One host: the hierarchical allreduce is neither measured nor a band.
    assert set(table.models) == set(SERIES.values()) - {"allreduce/hierarchical"}
    assert all(name != HIERARCHICAL for bands in table.bands.values() for _, name in bands)


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", RANKS)
def test_the_measured_bands_are_the_cheapest_by_the_measured_points(reports, ranks):
    table = AlgorithmTable.from_json(reports(ranks)[0][0]["table"])
    for (kind, reduces), names in CANDIDATES.items():
        for nbytes in (1, 4096, 30_000, 65536, 300_000, 1 << 20, 3 << 20, 16 << 20, 1 << 30):
            cost = {
                name: interpolated(table.models[SERIES[(kind, name)]].points, nbytes)
                for name in names
                if SERIES[(kind, name)] in table.models
            }
            chosen = table.choose(kind, nbytes, reduces)
            assert cost[chosen] <= min(cost.values()) * (1 + 1e-9), (kind, reduces, nbytes, cost)


def interpolated(points: list[tuple[int, float]], nbytes: int) -> float:
    """The cost the measurement says for `nbytes`: the first point's below it, the line
    through the two measured points around it, the last two points' line above them."""
    if nbytes <= points[0][0]:
        return points[0][1]
    pairs = list(zip(points, points[1:], strict=False))
    for k, ((n0, t0), (n1, t1)) in enumerate(pairs):
        if nbytes <= n1 or k == len(pairs) - 1:
            return t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)
    raise AssertionError("one measured point only")


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", RANKS)
def test_a_second_communicator_loads_the_cached_table(reports, ranks):
    found, outdir = reports(ranks)
    measured = AlgorithmTable.from_json(found[0]["table"])
    cached = {report["cached"] for report in found}
    assert len(cached) == 1
    table = AlgorithmTable.from_json(cached.pop())
    assert table.source == CACHED and table.bands == measured.bands
    files = [
        AlgorithmTable.from_json(path.read_text())
        for path in (outdir / "cache" / "ringplug").glob("algorithms-*.json")
    ]
    assert [table.models for table in files if table.size == ranks] == [measured.models]


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", RANKS)
def test_a_measurement_out_of_time_falls_back_to_the_fixed_table(reports, ranks):
    found, _ = reports(ranks)
    table = the_table_every_rank_got(found, "deadline")
    assert table.source == "fixed" and "only 1 size measured" in table.note
    assert table.bands == fixed_table(ranks, 1 << 20).bands


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3, 4, 5])
def test_a_process_set_measures_a_table_of_its_own_that_its_members_share(reports, ranks):
    found, outdir = reports(ranks)
    assert found[-1]["set_table"] is None
    table = the_table_every_rank_got(found[:-1], "set_table")
    assert table.size == ranks - 1 and table.source == MEASURED
    # Its own cache entry beside the world's: another rank count, another key.
    assert len(list((outdir / "cache" / "ringplug").glob("algorithms-*.json"))) == 2


# ------------------------------------------------------------- the hierarchical allreduce
def test_the_hierarchical_allreduce_gets_a_band_only_where_it_was_measured():
    models = {name: Model(1e-5, 1e-9) for name in set(SERIES.values())}
    del models["allreduce/hierarchical"]
    table = table_from_models(4, models, 0.1)
    assert all(name != HIERARCHICAL for bands in table.bands.values() for _, name in bands)
    # Measured and cheaper from 1 MiB on (its alpha 10 us higher, its beta 1e-11 s/B lower).
    models["allreduce/hierarchical"] = Model(2e-5, 1e-9 - 1e-11)
    table = table_from_models(4, models, 0.1)
    assert table.choose(ALLREDUCE, 999_999) == "mpi"
    assert table.choose(ALLREDUCE, 1_000_000) == HIERARCHICAL
    assert table.choose(ALLREDUCE, 1 << 30, mpi_reduces=False) == HIERARCHICAL
    assert table.choose(REDUCESCATTER, 1 << 30) != HIERARCHICAL


def test_the_hierarchy_needs_several_hosts_and_a_host_of_several_ranks():
    assert spans_hosts(["a", "a", "b", "b"]) and spans_hosts(["a", "a", "b"])
    assert not spans_hosts(["a", "a"]) and not spans_hosts(["a", "b", "c"])
    assert why_not(["vm", "vm"]) == "its 2 ranks are all on one host (vm)"
    assert why_not(["a", "b"]) == "each of its 2 ranks is on a host of its own"
    assert parse_forced("allreduce=hierarchical") == {ALLREDUCE: HIERARCHICAL}
    assert parse_forced("hierarchical") == {ALLREDUCE: HIERARCHICAL}


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", RANKS)
def test_forcing_the_hierarchical_allreduce_on_one_host_is_refused_on_every_rank(reports, ranks):
    for rank, report in enumerate(reports(ranks)[0]):
        assert report["refused"] == (
            "RINGPLUG_ALGORITHM forces allreduce=hierarchical, which needs ranks on more "
            "than one host with more than one rank on some host, but its "
            f"{ranks} ranks are all on one host ({socket.gethostname()}); unset it, or "
            "force another allreduce (mpi, doubling, ring)."
        ), rank


HIERARCHICAL_WORKER = Path(__file__).parent / "workers" / "hierarchical.py"


def hierarchical_reports(outdir: Path, ranks: int, per_host: int, measure: bool) -> list[dict]:
    """Each rank's report of tests/workers/hierarchical.py on `ranks` ranks of this machine,
    `per_host` to a pretend host (the test-only RINGPLUG_TEST_RANKS_PER_HOST)."""
    result = run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        str(HIERARCHICAL_WORKER),
        str(outdir),
        *(["measure"] if measure else []),
        extra_env={
            "RINGPLUG_TEST_RANKS_PER_HOST": str(per_host),
            "RINGPLUG_ALGORITHM": "allreduce=hierarchical",
            "RINGPLUG_CALIBRATION": "fresh",
            "RINGPLUG_CALIBRATION_SECONDS": "30",  # every size measured, whatever the load
            "XDG_CACHE_HOME": str(outdir / "cache"),
            "RINGPLUG_EAGER_THRESHOLD": "0",
            "RINGPLUG_RING_SEGMENT": "16K",
        },
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return [json.loads((outdir / f"hierarchical-{r}.json").read_text()) for r in range(ranks)]


def check_hierarchical_reports(found: list[dict], hosts: list[str], measured: bool) -> None:
    """Every case right and hierarchical on every rank; the measured table, if `measured`,
    has its model."""
    even = len({hosts.count(host) for host in hosts}) == 1
    for rank, report in enumerate(found):
        assert report["hosts"] == hosts
        assert report["columns"] == even  # the 300,001-element cases went by columns
        bad = {n: c["detail"] for n, c in report["cases"].items() if not c["ok"]}
        assert not bad, f"rank {rank}: {bad}"
        paths = {n: c["path"] for n, c in report["cases"].items()}
        assert set(paths.values()) == {HIERARCHICAL}, f"rank {rank}: {paths}"
        assert len(paths) == 9 * 5 + 1  # REDUCE_CASES x SIZES, and the grouped call
    tables = {report["table"] for report in found}
    assert len(tables) == 1
    if measured:
        table = AlgorithmTable.from_json(tables.pop())
        assert table.source == MEASURED and "allreduce/hierarchical" in table.models
    else:
        assert tables == {None}


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("ranks", "per_host", "hosts", "measure"),
    # 5: three leaders, a host of one; its table is not measured (time: the 4 do it)
    [(4, 2, [0, 0, 1, 1], True), (5, 2, [0, 0, 1, 1, 2], False)],
)
def test_the_hierarchical_allreduce_matches_numpy_on_pretend_hosts(
    tmp_path, ranks, per_host, hosts, measure
):
    found = hierarchical_reports(tmp_path, ranks, per_host, measure)
    check_hierarchical_reports(found, [f"test-host-{h}" for h in hosts], measure)
