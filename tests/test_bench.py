"""`ringplug-bench allreduce` runs every competitor in one job and reports comparable rows.

These tests check what the benchmark reports and how, never how fast anything was.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytestmark = pytest.mark.multirank

BENCH = str(Path(sys.executable).parent / "ringplug-bench")
SIZES = [4096, 8192, 16384]


def run_allreduce_bench(outdir: Path, min_size: str, max_size: str, *options: str):
    """`ringplug-bench allreduce` on 2 ranks with a tiny budget, its JSON in `outdir`: the
    result and the JSON document."""
    result = run_ringrun(
        "-np",
        "2",
        BENCH,
        "allreduce",
        "--min-size",
        min_size,
        "--max-size",
        max_size,
        "--budget",
        "0.005",
        "--min-iters",
        "3",
        "--warmup",
        "1",
        "--json",
        str(outdir / "allreduce.json"),
        *options,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result, json.loads((outdir / "allreduce.json").read_text())


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("bench")
    result, document = run_allreduce_bench(
        outdir, "4K", "16K", "--plot", str(outdir / "allreduce.png")
    )
    return result, document, outdir


def test_json_has_one_record_per_implementation_and_size(bench_run):
    _, document, _ = bench_run
    assert document["bench"] == "allreduce"
    seen = {(row["impl"], row["bytes"]) for row in document["results"]}
    assert seen == {
        (impl, size) for impl in ("ringplug", "mpi", "gloo", "python", "memory") for size in SIZES
    }
    for row in document["results"]:
        assert (row["op"], row["dtype"], row["ranks"]) == ("sum", "float32", 2)
        assert row["time_s"] > 0 and row["iterations"] >= 3


def test_bandwidths_follow_from_size_and_time(bench_run):
    _, document, _ = bench_run
    for row in document["results"]:
        algbw = row["bytes"] / row["time_s"] / 1e9
        assert row["algbw_gbs"] == pytest.approx(algbw)
        # busbw = algbw * 2(n-1)/n for a collective on n ranks; the memory row is local work.
        factor = 1.0 if row["impl"] == "memory" else 2 * (2 - 1) / 2
        assert row["busbw_gbs"] == pytest.approx(algbw * factor)


def test_env_records_what_makes_runs_comparable(bench_run):
    _, document, _ = bench_run
    env = document["env"]
    assert env["ranks"] == 2
    assert env["mpi_library"].startswith("MPICH")
    assert {"numpy", "mpi4py", "torch"} <= set(env["versions"])
    assert env["ring_threshold"] > 0


def test_table_prints_a_row_per_size_with_ratios_on_rank_0_only(bench_run):
    result, _, _ = bench_run
    rows = [line for line in result.stdout.splitlines() if line.startswith("[0]    ")]
    assert [row.split()[1] for row in rows] == ["4K", "8K", "16K"]
    assert all(
        all(f"{impl} " in row for impl in ("mpi", "gloo", "python", "memory")) for row in rows
    )
    assert not any(line.startswith("[1]") for line in result.stdout.splitlines())


def test_the_record_and_torch_rows_run_beside_ringplugs_own(tmp_path):
    # ringplug-norecord: the same engine with its flight record off, up to 64K, with the
    # record's cost; ringplug-torch: ringplug.torch.allreduce_, checked like the others.
    result, document = run_allreduce_bench(
        tmp_path, "32K", "128K", "--impls", "ringplug,ringplug-norecord,ringplug-torch,mpi"
    )
    seen = {(row["impl"], row["bytes"]) for row in document["results"]}
    sizes = [32768, 65536, 131072]
    assert seen == {
        (impl, size) for impl in ("ringplug", "ringplug-torch", "mpi") for size in sizes
    } | {("ringplug-norecord", size) for size in sizes[:2]}
    rows = [line for line in result.stdout.splitlines() if line.startswith("[0]    ")]
    assert [row.split()[1] for row in rows] == ["32K", "64K", "128K"]
    assert ["record " in row for row in rows] == [True, True, False]
    assert all("ringplug-torch " in row for row in rows)


def test_plot_is_a_png(bench_run):
    _, _, outdir = bench_run
    assert (outdir / "allreduce.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fusion_bench_reports_every_implementation_on_resnet50_gradients(tmp_path):
    result = run_ringrun(
        "-np",
        "2",
        BENCH,
        "fusion",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--impls",
        "ringplug,ringplug-views,single,copy,gloo,small",
        "--json",
        str(tmp_path / "fusion.json"),
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "fusion.json").read_text())
    rows = {row["impl"]: row for row in document["results"]}
    assert set(rows) == {
        "ringplug",
        "ringplug-views",
        "single",
        "copy",
        "gloo",
        "small-1",
        "small-1000",
        "small-1000-grouped",
        "small-1000-grouped-in-place",
        "single-4M",
    }
    assert document["env"]["tensors"] == 161 and document["env"]["parameters"] == 25_557_032
    assert rows["ringplug"]["tensors"] == 161 and rows["single"]["tensors"] == 1
    assert rows["ringplug"]["bytes"] == rows["single"]["bytes"] == 25_557_032 * 4
    assert "ringplug / (single + copy) =" in result.stdout


def run_bench(tmp_path: Path, name: str, *args: str) -> tuple[str, list[dict]]:
    """`ringplug-bench NAME ARGS --json ...` as a plain command: its stdout and JSON rows."""
    out = tmp_path / f"{name}.json"
    result = subprocess.run(
        [BENCH, name, *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(out.read_text())
    assert document["bench"] == name
    return result.stdout, document["results"]


@pytest.mark.parametrize(
    ("name", "competitor", "summary", "options"),
    [
        (
            "lightning",
            ["ring", "ddp", "none"],
            "median RingStrategy / DDP throughput",
            ["--tiny-steps", "8"],
        ),
        ("keras", ["ringplug", "mwms", "plain"], "median ringplug / MWMS throughput", []),
    ],
)
def test_training_benches_run_both_sides_in_alternating_pairs(
    tmp_path, name, competitor, summary, options
):
    pytest.importorskip(name)
    if name == "keras":
        pytest.importorskip("tensorflow")
    ours, theirs, alone = competitor
    # One pair of each comparison (each job a fresh Lightning or Keras process: 10 s each
    # here); that the order flips from pair to pair is tests/test_bench_schedule.py's.
    stdout, rows = run_bench(
        tmp_path, name, "--pairs", "1", "--steps", "6", "--hidden", "32", *options
    )
    first = [ours, theirs, f"{ours}-1", alone]
    ranks = [2, 2, 1, 1]
    if name == "lightning":  # and the tiny model's per-step comparison
        first += ["ring-tiny", "ddp-tiny"]
        ranks += [2, 2]
        assert "tiny MLP (8 wide), 2 ranks, median time per step: RingStrategy" in stdout
    assert [row["impl"] for row in rows] == first
    assert all(row["samples_per_s"] > 0 for row in rows)
    assert [row["ranks"] for row in rows] == ranks
    assert summary in stdout


def test_autotune_bench_tunes_from_the_bad_setting_and_judges_it_beside_the_sweeps_best(tmp_path):
    result = run_ringrun(
        "-np",
        "2",
        *("-x", "RINGPLUG_AUTOTUNE_WARMUP_SAMPLES=0"),
        *("-x", "RINGPLUG_AUTOTUNE_STEPS_PER_SAMPLE=2"),
        *("-x", "RINGPLUG_AUTOTUNE_MAX_SAMPLES=3"),
        BENCH,
        "autotune",
        *("--iters", "1", "--sweep-rounds", "1", "--rounds", "2", "--tuning-steps", "8"),
        *("--json", str(tmp_path / "autotune.json")),
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "autotune.json").read_text())
    assert set(document["sweep_median_step_s"]) == {
        "1024K/0ms",
        "4096K/0ms",
        "16384K/0ms",
        "65536K/0ms",
        "131072K/0ms",
        "65536K/1ms",
        "65536K/5ms",
    }
    assert set(document["judgement_median_step_s"]) == {
        "bad start",
        "best of sweep",
        "autotuned",
        "best again",
    }
    assert len(document["round_ratios"]) == len(document["best_vs_itself"]) == 2
    low, high = document["ratio_quartiles"]
    assert low <= document["ratio_median"] <= high
    assert document["trials"][0][0] == "64K/20ms"  # tuning starts at the bad setting
    assert len(document["trials"]) == document["samples"] == 3  # the budget given
    assert document["tuning_steps"] <= 8
    assert document["tuned"] in [label for label, _ in document["trials"]]
    sweep = document["sweep_median_step_s"]
    assert document["best_of_sweep"] == min(sweep, key=sweep.__getitem__)
    assert "autotuned (" in result.stdout and "tuning used" in result.stdout


def test_sampler_bench_compares_padding_and_epoch_time(tmp_path):
    pytest.importorskip("PIL")
    _, results = run_bench(
        tmp_path, "sampler", "--samples", "2000", "--timed-samples", "128", "--repeats", "1"
    )
    rows = {row["impl"]: row for row in results}
    assert set(rows) == {"bucket", "random"}
    # Buckets of similar widths pad far less than random batches of the same size.
    assert rows["bucket"]["padding_per_real"] * 2 <= rows["random"]["padding_per_real"]
    assert rows["bucket"]["batches_per_rank"] == rows["random"]["batches_per_rank"]


def test_algorithms_bench_prints_the_calibration_and_ratios_to_mpi(tmp_path):
    result = run_ringrun(
        "-np",
        "2",
        BENCH,
        "algorithms",
        "--sizes",
        "4K,64K",
        "--budget",
        "0.01",
        "--deadline",
        "60",
        "--json",
        str(tmp_path / "algorithms.json"),
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "algorithms.json").read_text())
    models = document["table"]["models"]
    assert len(models) == 8 and all(len(m["points"]) == 4 for m in models.values())
    for name, model in models.items():
        # each series' line: its four measured points and its model
        line = next(row for row in result.stdout.splitlines() if f"# {name} " in row)
        points = line.split("|")[0]
        assert len(re.findall(r"\d+\.\d \( *[+-]\d+%\)", points)) == 4, line
        assert f"alpha {model['alpha'] * 1e6:.1f} us" in line
    assert "# crossovers" in result.stdout
    rows = document["comparison"]
    assert [row["bytes"] for row in rows] == [4096, 65536]
    for row in rows:
        mpi = row["MPI Allreduce"]["time_s"]
        for name in ("mpi", "doubling", "ring", "ringplug"):
            assert row[name]["ratio_to_mpi"] == pytest.approx(mpi / row[name]["time_s"])
    assert result.stdout.count("[0] #    4K |") == 1 and "[1] #" not in result.stdout
