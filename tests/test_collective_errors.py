"""Bad or mismatched calls raise on every rank with a message that names who did what."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytestmark = pytest.mark.multirank

WORKERS = Path(__file__).parent / "workers"
RANKS = 3


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    outdir = tmp_path_factory.mktemp("errors")
    result = run_ringrun(
        "-np", str(RANKS), sys.executable, str(WORKERS / "errors.py"), str(outdir), timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads((outdir / f"errors-{r}.json").read_text()) for r in range(RANKS)]


def test_shape_mismatch_names_every_rank_and_shape_on_every_rank(seen):
    for rank_view in seen:
        error = rank_view["shape"]
        assert error["type"] == "MismatchError"
        assert "'grad/w' does not match across ranks" in error["message"]
        for rank, shape in ((0, "(4,)"), (1, "(5,)"), (2, "(6,)")):
            assert f"rank {rank} submitted allreduce with shape {shape} float32" in error["message"]


def test_mismatch_above_the_eager_size_is_caught_before_any_data_moves(seen):
    for rank_view in seen:
        assert rank_view["shape-large"]["type"] == "MismatchError"
        assert "(1000002,)" in rank_view["shape-large"]["message"]


@pytest.mark.parametrize(
    ("scenario", "fragments"),
    [
        (
            "dtype",
            [
                "rank 0 submitted allreduce with shape (8,) float32",
                "ranks 1, 2 submitted allreduce with shape (8,) float64",
            ],
        ),
        ("op", ["op=sum", "ranks 1, 2 submitted", "op=max"]),
        (
            "root",
            ["rank 0 submitted broadcast", "root_rank=0", "ranks 1, 2 submitted", "root_rank=1"],
        ),
        ("kind", ["rank 0 submitted allreduce", "ranks 1, 2 submitted broadcast"]),
        (
            "allgather-trailing",
            [
                "rows of shape (3,)",
                "rows of shape (4,)",
                "rows of shape (5,)",
                "first dimension differ",
            ],
        ),
    ],
)
def test_mismatches_raise_the_same_mismatch_error_everywhere(seen, scenario, fragments):
    messages = {rank_view[scenario]["message"] for rank_view in seen}
    types = {rank_view[scenario]["type"] for rank_view in seen}
    assert types == {"MismatchError"}
    for message in messages:
        for fragment in fragments:
            assert fragment in message


def test_bad_arguments_on_every_rank_raise_the_plain_error_everywhere(seen):
    for rank_view in seen:
        assert rank_view["root-out-of-range"]["type"] == "ValueError"
        assert "root_rank=6 is not a rank of this job" in rank_view["root-out-of-range"]["message"]
        assert rank_view["integer-average"]["type"] == "TypeError"
        assert "use op=Sum" in rank_view["integer-average"]["message"]


@pytest.mark.parametrize(
    ("scenario", "culprit", "own_type", "own_text"),
    [
        ("root-out-of-range-one-rank", 1, "ValueError", "not a rank of this job"),
        ("unsupported-dtype-one-rank", 1, "TypeError", "Unsupported dtype complex64"),
        ("bad-splits-one-rank", 1, "ValueError", "splits must be 3 non-negative"),
        ("unpicklable-on-root", 0, "TypeError", "Cannot pickle function"),
    ],
)
def test_bad_arguments_on_one_rank_fail_there_and_release_the_others(
    seen, scenario, culprit, own_type, own_text
):
    for rank, rank_view in enumerate(seen):
        error = rank_view[scenario]
        if rank == culprit:
            assert error["type"] == own_type
            assert own_text in error["message"]
        else:
            assert error["type"] == "PeerArgumentError"
            assert f"rank(s) {culprit} rejected their arguments" in error["message"]


def test_a_wrong_out_array_is_rejected_without_hanging(seen):
    assert seen[0]["wrong-out"]["type"] == "PeerArgumentError"
    for rank_view in seen[1:]:
        assert rank_view["wrong-out"]["type"] == "ValueError"


def test_ranks_stay_in_step_after_every_error(seen):
    assert all(rank_view["after"]["ok"] for rank_view in seen)
