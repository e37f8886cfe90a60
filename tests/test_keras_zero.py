"""Keras ``DistributedOptimizer(..., zero=1)`` on real ranks: sharded optimizer state trains as
``zero=0`` does, on every backend.

One job per (backend, world size) runs every scenario of workers/keras_zero.py: torch (the
quickest to start) on 3 ranks, which also writes a BackupAndRestore backup, then TensorFlow,
torch and JAX on 2 ranks, each restoring that 3-rank backup, sharded and not (the backup's
files are Keras's, the same whatever the backend).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("keras")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "keras_zero.py")
BACKENDS = ["tensorflow", "torch", "jax"]
CASES = [
    *(f"{kind}-{mode}" for kind in ("sgd", "adam", "adamw")
      for mode in ("plain", "global_clipnorm+accumulate")),
    "sgd-clipnorm",
    "adam-ema",
]  # fmt: skip


def _job(outdir: Path, backend: str, ranks: int, scenarios: list[str], **env: str) -> list[dict]:
    result = run_ringrun(
        "-np",
        str(ranks),
        sys.executable,
        WORKER,
        str(outdir),
        *scenarios,
        extra_env={
            "KERAS_BACKEND": backend,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "RINGPLUG_TIMEOUT": "60",  # a rank left waiting fails the job instead of hanging
            **env,
        },
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    reports = [json.loads((outdir / f"zero-{r}.json").read_text()) for r in range(ranks)]
    assert {(r["backend"], r["size"]) for r in reports} == {(backend, ranks)}
    return reports


JOBS = [("torch", 3), *((backend, 2) for backend in BACKENDS)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """``jobs(backend, ranks)``: that job's folder and reports, run once; a 2-rank job
    restores the backup of the 3-rank job."""
    done: dict[tuple[str, int], dict] = {}

    def get(backend: str, ranks: int) -> dict:
        if (backend, ranks) not in done:
            pytest.importorskip(backend)
            outdir = tmp_path_factory.mktemp(f"keras-zero-{backend}-{ranks}")
            if ranks == 3:
                reports = _job(outdir, backend, 3, ["equal", "empty", "backup_write"])
            else:
                source = get("torch", 3)["outdir"]
                scenarios = ["equal", "empty", "backup_read", "save_load"]
                reports = _job(outdir, backend, 2, scenarios, ZERO_BACKUP_FROM=str(source))
            done[(backend, ranks)] = {"outdir": outdir, "reports": reports, "size": ranks}
        return done[(backend, ranks)]

    return get


@pytest.fixture(params=JOBS, ids=[f"{b}-{n}ranks" for b, n in JOBS])
def job(request, jobs) -> dict:
    return jobs(*request.param)


@pytest.fixture(params=BACKENDS)
def two(request, jobs) -> dict:
    return jobs(request.param, 2)


@pytest.mark.parametrize("case", CASES)
def test_sharded_weights_equal_the_unsharded_run_on_every_rank(job, case):
    for report in job["reports"]:
        found = report["equal"][case]
        assert found["relative_difference"] < 1e-6, found
        assert found["ranks_identical"] and found["moved"]
        assert found["steps"] == 20  # optimizer updates (40 batches when accumulating 2)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_at_most_its_share_of_the_optimizer_state(job, case):
    size = job["size"]
    sizes = [report["equal"][case]["state_bytes"] for report in job["reports"]]
    whole = job["reports"][0]["equal"][case]["unsharded_state_bytes"]
    assert whole > 0
    assert all(0 < mine <= whole / size * 1.05 for mine in sizes), (sizes, whole)
    assert sum(sizes) == whole  # every slot exists once, on its owner


def test_a_model_with_fewer_variables_than_ranks_still_trains_as_unsharded(job):
    for case in ("adam-global_clipnorm", "sgd-global_clipnorm+accumulate"):
        found = [report["empty"][case] for report in job["reports"]]
        assert all(f["relative_difference"] < 1e-6 and f["ranks_identical"] for f in found)
        # One variable: one rank holds its slots, the others none, and all count the steps.
        assert sorted(f["state_bytes"] > 0 for f in found) == [False] * (job["size"] - 1) + [True]
        assert len({f["steps"] for f in found}) == 1


def test_a_backup_of_3_ranks_restores_on_2_and_trains_on_as_unsharded(two):
    for report in two["reports"]:
        found = report["backup_read"]
        for zero in ("zero1", "zero0"):
            restored = found[zero]
            assert restored["restored_steps"] == 20 and restored["steps"] == 30
            assert restored["weights_restored"] == 0.0
            if "state_restored" in restored:  # rank 0 holds the consolidated state
                assert restored["state_restored"] == 0.0
                assert restored["state_length"][0] == restored["state_length"][1]
        assert found["continued_relative_difference"] < 1e-6


def test_a_consolidated_save_and_checkpoint_load_in_one_process_with_the_whole_state(two):
    first, *others = two["reports"]
    found = first["save_load"]
    assert found["plain_class"] and found["class"].startswith("keras.")
    assert found["state_relative_difference"] < 1e-6
    assert found["checkpoint_state_relative_difference"] < 1e-6  # the last epoch's
    assert found["batches_checkpoint_state_relative_difference"] < 1e-6  # the 20th batch's
    assert found["weights_relative_difference"] < 1e-6
    assert found["trained_on"] == 1 and found["loss_finite"]
    for report in two["reports"]:  # saving before consolidating is refused, saying why
        assert "ringplug.keras.consolidate" in report["save_load"]["refused"]
