"""ringplug finds its place in the job under each way of starting it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

WORKERS = Path(__file__).parent / "workers"
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def read_topologies(outdir: Path, ranks: int) -> list[dict]:
    return [json.loads((outdir / f"topology-{r}.json").read_text()) for r in range(ranks)]


def expect_one_host(facts: list[dict], ranks: int) -> None:
    for rank, fact in enumerate(facts):
        assert (fact["rank"], fact["size"]) == (rank, ranks)
        assert (fact["local_rank"], fact["local_size"]) == (rank, ranks)
        assert (fact["cross_rank"], fact["cross_size"]) == (0, 1)
        assert fact["everyone"] == list(range(ranks))
        assert fact["after_shutdown"] is False
        assert fact["rejoined_sum"] == ranks


@pytest.mark.multirank
def test_ranks_started_by_ringrun_know_their_place(tmp_path):
    result = run_ringrun(
        "-np", "3", sys.executable, str(WORKERS / "topology.py"), str(tmp_path), timeout=60
    )
    assert result.returncode == 0, result.stderr
    expect_one_host(read_topologies(tmp_path, 3), 3)


@pytest.mark.multirank
def test_ranks_started_by_plain_mpiexec_know_their_place(tmp_path):
    result = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(WORKERS / "topology.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expect_one_host(read_topologies(tmp_path, 2), 2)


def test_a_plain_python_process_is_a_world_of_one(tmp_path):
    result = subprocess.run(
        [sys.executable, str(WORKERS / "topology.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expect_one_host(read_topologies(tmp_path, 1), 1)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "SLURM_"))}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env=environment, check=False,
    )  # fmt: skip


def test_without_any_mpi_library_a_script_still_runs_as_one_process():
    result = run_python(
        "import ringplug, numpy as np; ringplug.init();"
        "print(ringplug.size(), ringplug.allreduce(np.arange(3.0), op='sum'))",
        MPI4PY_LIBMPI="/nonexistent/libmpi.so",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1 [0. 1. 2.]"


def test_a_launched_rank_without_mpi_says_what_to_install():
    result = run_python(
        "import ringplug; ringplug.init()", MPI4PY_LIBMPI="/nonexistent/libmpi.so", PMI_SIZE="2"
    )
    assert result.returncode != 0
    assert "started as one of 2 ranks by MPICH/hydra (PMI)" in result.stderr
    assert "pip install 'ringplug[mpich]'" in result.stderr


def test_srun_without_the_mpi_plugin_is_caught_instead_of_training_alone():
    # srun started 2 tasks but each sees an MPI world of 1: N copies would train apart.
    result = run_python("import ringplug; ringplug.init()", SLURM_STEP_NUM_TASKS="2",
                        SLURM_PROCID="0")  # fmt: skip
    assert result.returncode != 0
    assert "srun started 2 ranks, but MPI sees a world of 1" in result.stderr
    assert "--mpi=pmi2" in result.stderr
