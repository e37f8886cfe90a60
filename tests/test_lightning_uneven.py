"""RingStrategy when ranks have different numbers of batches: no hang, no mixed epochs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun, torchrun_workers_refused

pytest.importorskip("lightning")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "lightning_uneven.py")
IN_TURN = str(Path(__file__).parent / "workers" / "in_turn.py")
EPOCHS = 2


def job(tmp_path: Path, *args: str, ranks: int, package: str = "lightning"):
    """Run the worker on `ranks` ranks with `package`'s Lightning (see lightning_namespace)."""
    result = run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        WORKER,
        *args,
        str(tmp_path),
        extra_env={"TEST_LIGHTNING_PACKAGE": package},
        timeout=240,
    )
    output = result.stdout + result.stderr
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    return result.returncode, output, reports


# The runs that pass share a job per number of ranks and Lightning package: the worker runs
# once per entry, one after the other in the same ranks (workers/in_turn.py), so Lightning is
# imported once per rank. The SIGTERM'd fit goes last: it ends with SIGTERMException.
SHARED = {
    (2, "lightning"): [
        ("iterable", "drop", "6,4"),
        ("map", "drop", "6,4"),
        ("map", "join", "6,4"),
        ("eval", "-", "-"),
        ("sigterm", "-", "-"),
    ],
    (3, "lightning"): [
        ("iterable", "drop", "6,4,5"),
        ("iterable", "join", "6,4,5"),
        ("eval", "-", "-"),
    ],
    (2, "pytorch_lightning"): [("map", "join", "6,4")],
}
RANK_LINE = re.compile(r"\[(\d+)\] ")
BEGINS = re.compile(r"\[(\d+)\] in_turn: (\d+) \S+ begins$")


def output_of(stream: str, index: int) -> str:
    """The lines of run `index` of an in_turn job in one stream of its output: each rank's
    lines from its marker of that run to its next, and ringrun's own lines."""
    current: dict[str, int] = {}
    kept = []
    for line in stream.splitlines():
        marker = BEGINS.match(line)
        if marker:
            current[marker.group(1)] = int(marker.group(2))
            continue
        rank = RANK_LINE.match(line)
        if rank is None or current.get(rank.group(1)) == index:
            kept.append(line)
    return "\n".join(kept)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``shared(source, mode, counts, ranks, package)``: the run's exit status (the shared
    job's), its output and its reports, as `job` gives them."""
    jobs: dict[tuple[int, str], tuple[subprocess.CompletedProcess[str], Path]] = {}

    def run(*args: str, ranks: int, package: str = "lightning"):
        key = (ranks, package)
        if key not in jobs:
            outdir = tmp_path_factory.mktemp(f"uneven-{ranks}-{package}")
            arguments = []
            for index, run_args in enumerate(SHARED[key]):
                (outdir / str(index)).mkdir()
                arguments += ["+", "lightning_uneven.py", *run_args, str(outdir / str(index))]
            result = run_ringrun(
                "-np",
                str(ranks),
                sys.executable,
                IN_TURN,
                *arguments[1:],
                extra_env={"TEST_LIGHTNING_PACKAGE": package},
                timeout=480,
            )
            jobs[key] = (result, outdir)
        result, outdir = jobs[key]
        index = SHARED[key].index(args)
        if result.returncode != 0:
            return result.returncode, result.stdout + result.stderr, []
        output = output_of(result.stdout, index) + "\n" + output_of(result.stderr, index)
        folder = outdir / str(index)
        reports = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
        return result.returncode, output, reports

    return run


def assert_trained_as_the_mode_defines(reports: list[dict], ranks: int, steps: int) -> None:
    assert len(reports) == ranks
    for report in reports:
        assert report["max_difference"] < 1e-5, report
        assert report["other_mode_difference"] > 1e-3  # the reference tells the modes apart
        assert report["ranks_identical"]
        assert report["steps"] == report["global_step"] == EPOCHS * steps
        assert report["epochs"] == EPOCHS


@pytest.mark.parametrize("counts", ["6,4", "6,4,5"])
def test_iterable_data_drop_ends_every_epoch_together_at_the_shortest_rank(shared, counts):
    ranks = len(counts.split(","))
    rc, output, reports = shared("iterable", "drop", counts, ranks=ranks)
    assert rc == 0, output
    assert_trained_as_the_mode_defines(reports, ranks, steps=4)
    dropping = "rank 0 dropped what" if ranks == 2 else "ranks 0, 2 dropped what"
    for epoch in range(EPOCHS):  # one warning per epoch, from rank 0 only
        line = f"rank 1 ran out of training data after 4 batches in epoch {epoch}; {dropping}"
        assert output.count(line) == 1, output


def test_sized_per_rank_data_drop_warns_with_the_counts(shared):
    rc, output, reports = shared("map", "drop", "6,4", ranks=2)
    assert rc == 0, output
    assert_trained_as_the_mode_defines(reports, 2, steps=4)
    for epoch in range(EPOCHS):
        line = (
            f"the ranks have 6, 4 training batches; in epoch {epoch} every rank runs 4 and "
            "rank 0 drops 2"
        )
        assert output.count(line) == 1, output


@pytest.mark.parametrize(
    ("source", "counts", "package"),
    [
        ("iterable", "6,4,5", "lightning"),
        ("map", "6,4", "lightning"),
        ("map", "6,4", "pytorch_lightning"),
    ],
)
def test_join_trains_on_every_batch_with_zeros_from_ranks_out_of_data(
    shared, source, counts, package
):
    ranks = len(counts.split(","))
    rc, output, reports = shared(source, "join", counts, ranks=ranks, package=package)
    assert rc == 0, output
    assert_trained_as_the_mode_defines(reports, ranks, steps=6)
    assert "RingStrategy(uneven=" not in output  # nothing dropped, nothing to warn about


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "iterable",
            "RingStrategy(uneven='error'): rank 1 ran out of training data in epoch 0 "
            "after 4 batches while rank 0 had more",
        ),
        (
            "map",
            "RingStrategy(uneven='error'): the ranks have different numbers of training "
            "batches (rank 0: 6, rank 1: 4)",
        ),
    ],
)
def test_error_mode_fails_on_every_rank_naming_the_ranks_and_counts(tmp_path, source, message):
    rc, output, reports = job(tmp_path, source, "error", "6,4", ranks=2)
    assert rc != 0
    assert reports == []
    for rank in range(2):
        assert f"[{rank}] ringplug.core.errors.RingplugError: {message}" in output, output


@pytest.mark.parametrize("ranks", [2, 3])
def test_evaluation_counts_every_sample_once_when_ranks_get_different_counts(shared, ranks):
    rc, output, reports = shared("eval", "-", "-", ranks=ranks)
    assert rc == 0, output
    samples = reports[0]["samples"]
    assert sum(r["val_samples_here"] for r in reports) == samples  # no padded repeats
    assert len({r["val_samples_here"] for r in reports}) == 2  # the ranks' counts differ
    for report in reports:
        assert report["val_count"] == samples
        assert report["val_mean"] == pytest.approx(report["true_mean"], rel=1e-6)
        assert report["test_mean"] == pytest.approx(report["true_mean"], rel=1e-6)
        assert report["predicted_sorted"]  # predict too: every sample exactly once


def test_a_sigterm_on_any_rank_stops_every_rank_at_the_same_batch(shared):
    # Lightning broadcasts rank 0's flag only; the batch agreement carries every rank's.
    rc, output, reports = shared("sigterm", "-", "-", ranks=2)
    assert rc == 0, output  # SIGTERMException is a SystemExit: a clean stop
    assert [r["exception"] for r in reports] == ["SIGTERMException"] * 2, output
    # Set on rank 1 after its third step. The agreements run a batch ahead of training, so
    # every rank learns it in the fifth step and both stop at its end.
    assert [r["global_step"] for r in reports] == [5, 5]


def test_under_torchrun_ring_strategy_stops_at_once_saying_what_to_run(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this interpreter")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", WORKER, "map", "drop", "6,4", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert torchrun_workers_refused(output, 2), output  # each worker, or stopped by torchrun
    assert "Start the job with `ringrun -np 2 python ...`" in output
    assert list(tmp_path.glob("*.json")) == []  # neither trained a model of its own
