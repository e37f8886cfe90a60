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
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    expect_one_host(read_topologies(tmp_path, 2), 2)


def test_a_plain_python_process_is_a_world_of_one(tmp_path):
    result = subprocess.run(
        [sys.executable, str(WORKERS / "topology.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    expect_one_host(read_topologies(tmp_path, 1), 1)


def run_python(code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "SLURM_"))}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        check=False,
    )


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
    result = run_python(
        "import ringplug; ringplug.init()", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0"
    )
    assert result.returncode != 0
    assert "srun started 2 ranks, but MPI sees a world of 1" in result.stderr
    assert "--mpi=pmi2" in result.stderr


# What torch's launchers set, without an MPI launcher: a Kubeflow PyTorchJob gives each pod
# MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK (and PYTHONUNBUFFERED), nothing of torchelastic;
# torchrun also sets LOCAL_RANK and the TORCHELASTIC_* variables.
PYTORCHJOB_ENV = {
    "MASTER_ADDR": "trainer-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "4",
    "RANK": "1",
    "PYTHONUNBUFFERED": "1",
}
TORCHRUN_ENV = {
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "WORLD_SIZE": "2",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "ROLE_RANK": "0",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
}


def test_ringplug_init_in_a_pytorchjob_pod_stops_and_says_to_use_an_mpijob():
    result = run_python(
        "import ringplug; ringplug.init(); print('trained alone')", **PYTORCHJOB_ENV
    )
    assert result.returncode != 0
    assert "trained alone" not in result.stdout
    assert "started by torch's launcher as rank 1 of 4" in result.stderr
    assert "Start the job with `ringrun -np 4 python ...`" in result.stderr
    assert "use an MPIJob (the MPI Operator) rather than a PyTorchJob" in result.stderr


def test_ringplug_init_under_torchrun_variables_names_torchrun():
    result = run_python("import ringplug; ringplug.init()", **TORCHRUN_ENV)
    assert result.returncode != 0
    assert "started by torchrun as rank 0 of 2" in result.stderr
    assert "`ringrun -np 2 python ...`" in result.stderr


def test_a_pytorchjob_of_one_pod_is_a_world_of_one():
    env = {**PYTORCHJOB_ENV, "WORLD_SIZE": "1", "RANK": "0"}
    result = run_python("import ringplug; ringplug.init(); print(ringplug.size())", **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def test_ring_strategy_in_a_pytorchjob_pod_stops_before_training():
    code = (
        "import lightning.pytorch as pl, ringplug.lightning\n"
        "pl.Trainer(strategy='ring', accelerator='cpu', logger=False)\n"
        "print('trainer built')\n"
    )
    result = run_python(code, timeout=180, **PYTORCHJOB_ENV)  # Lightning imports slowly
    assert result.returncode != 0
    assert "trainer built" not in result.stdout
    assert "started by torch's launcher as rank 1 of 4" in result.stderr
    assert "MPIJob" in result.stderr


def test_the_torch_backend_in_two_pytorchjob_pods_stops_on_both(tmp_path):
    # Two "pods" on this machine: torch's env:// rendezvous meets, then the backend refuses.
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "import datetime, torch.distributed as dist, ringplug.torch\n"
        "dist.init_process_group('ringplug', timeout=datetime.timedelta(seconds=60))\n"
        "print('joined')\n"
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "SLURM_"))}
    pods = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={
                **environment,
                **PYTORCHJOB_ENV,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "RANK": str(rank),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [pod.communicate(timeout=120) for pod in pods]
    for rank, (pod, (stdout, stderr)) in enumerate(zip(pods, outputs, strict=True)):
        assert pod.returncode != 0
        assert "joined" not in stdout
        assert f"started by torch's launcher as rank {rank} of 2" in stderr, stderr


def test_an_mpi_launchers_world_wins_over_a_world_size_left_in_the_environment(monkeypatch):
    from ringplug.core.errors import RingplugError
    from ringplug.core.runtime import refuse_torchrun_world

    for variable in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RingplugError, match="ringrun -np 2"):
        refuse_torchrun_world()
    monkeypatch.setenv("PMI_SIZE", "2")  # ringrun/mpiexec started it: MPI's world is the job's
    refuse_torchrun_world()


@pytest.mark.multirank
def test_under_plain_mpiexec_ring_strategy_gives_lightning_the_true_rank(tmp_path):
    pytest.importorskip("lightning")
    code = (
        "import os\n"
        "import lightning\n"
        "from lightning.pytorch.utilities.rank_zero import rank_zero_only\n"
        "from torchmetrics.utilities.prints import rank_zero_only as metrics_rank\n"
        "before = rank_zero_only.rank, metrics_rank.rank\n"
        "from ringplug.lightning import RingStrategy\n"
        "RingStrategy()\n"
        "env = os.environ\n"
        "facts = [*before, rank_zero_only.rank, metrics_rank.rank, env['RANK'],\n"
        "         env['WORLD_SIZE'], env['LOCAL_RANK']]\n"
        # A file per rank: two ranks printing through hydra at once can run into one line.
        f"open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').write(\n"
        "    ' '.join(map(str, facts)))\n"
    )
    result = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    facts = sorted(path.read_text().split() for path in tmp_path.iterdir())
    # Lightning and torchmetrics read 0 on both at import (mpiexec sets no RANK, LOCAL_RANK);
    # the strategy corrects them.
    assert facts == [["0", "0", "0", "0", "0", "2", "0"], ["0", "0", "1", "1", "1", "2", "1"]]
