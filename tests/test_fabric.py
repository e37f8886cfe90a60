"""Lightning Fabric with strategy="ring": N ranks train like one process on the union of
their batches, in ``lightning.fabric`` and in the standalone ``lightning_fabric``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("lightning")

WORKER = str(Path(__file__).parent / "workers" / "fabric_fit.py")
INTEGRATION = {
    "lightning.fabric": "ringplug.fabric",
    "lightning_fabric": "ringplug.lightning_fabric",
}


def reports_of(outdir: Path, ranks: int) -> list[dict]:
    return [json.loads((outdir / f"fabric-{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("package", "strategy", "launch", "ranks"),
    [
        ("lightning.fabric", "ring", "ringrun", 3),  # ringrun -np 3 python train.py
        ("lightning_fabric", "class", "devices", 2),  # python train.py, Fabric(devices=2)
    ],
)
def test_ranks_train_like_one_process_and_collectives_return_every_ranks_values(
    tmp_path, package, strategy, launch, ranks
):
    if launch == "ringrun":
        result = run_ringrun(
            "-np",
            str(ranks),
            sys.executable,
            WORKER,
            package,
            strategy,
            "auto",
            str(tmp_path),
            timeout=300,
        )
    else:
        result = subprocess.run(
            [sys.executable, WORKER, package, strategy, str(ranks), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    if launch == "devices":
        assert f"ringplug: starting {ranks} ranks" in output  # the script re-ran itself
    integration = INTEGRATION[package]
    n = ranks
    for rank, report in enumerate(reports_of(tmp_path, ranks)):
        assert report["rank"] == rank and report["size"] == n
        assert report["fabric"] == [rank, n, rank == 0]  # global_rank, world_size, is_global_zero
        assert report["strategy"] == f"{integration}.strategy.RingFabricStrategy"
        assert not report["other_fabric_imported"]
        for part, steps, reductions in (("plain", 4, 4), ("accumulate", 2, 2)):
            trained = report[part]
            assert trained["setup_gave_rank_zeros_weights"], part  # initial weights differed
            assert trained["max_difference"] < 1e-5, (part, trained["max_difference"])
            assert trained["ranks_identical"], part
            assert trained["grads_identical_after_backward"], part  # averaged during backward
            assert trained["steps"] == steps
            # One gradient reduction per optimizer step: no_backward_sync sent nothing.
            assert trained["collectives"] == reductions, part
            assert trained["sampler"] == ["DistributedSampler", n, rank]
        # Each rank gave [rank + 1, -2 (rank + 1)].
        ones = range(1, n + 1)
        assert report["all_reduce"] == {
            "mean": [sum(ones) / n, -2 * sum(ones) / n],
            "sum": [sum(ones), -2 * sum(ones)],
            "max": [n, -2],
            "min": [1, -2 * n],
        }
        assert report["input_unchanged"]
        assert report["int_mean"] == [sum(ones) / n, "torch.float32"]  # as DDP's: a float
        assert report["nested_sum"] == [sum(range(n)), n]
        assert report["all_gather"] == [[10 * r, 10 * r + 1, 10 * r + 2] for r in range(n)]
        assert report["broadcast"] == {"from": 1, "text": "rank 1"}
        assert report["all_agree"] is False and report["any_agrees"] is True


@pytest.mark.parametrize("package", ["lightning.fabric", "lightning_fabric"])
def test_import_ringplug_registers_strategy_ring_with_either_fabric(package):
    other = "lightning_fabric" if package == "lightning.fabric" else "lightning"
    code = (
        f"import sys, ringplug\nfrom {package} import Fabric\n"
        "fabric = Fabric(strategy='ring', accelerator='cpu')\n"
        "strategy = type(fabric.strategy)\n"
        f"print(strategy.__module__, strategy.__name__, {other!r} in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    integration = INTEGRATION[package]
    expected = f"{integration}.strategy RingFabricStrategy False"
    assert result.stdout.strip().splitlines()[-1] == expected


@pytest.mark.parametrize("torchelastic", [True, False], ids=["torchrun", "pytorchjob"])
def test_under_torch_launchers_fabric_ring_stops_at_once_saying_what_to_run(torchelastic):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env.update(
        {
            "RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    if torchelastic:
        env["TORCHELASTIC_RUN_ID"] = "job-1"
    code = "import ringplug\nfrom lightning.fabric import Fabric\nFabric(strategy='ring')\n"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert result.returncode != 0
    by = "torchrun" if torchelastic else "torch's launcher"
    assert f"was started by {by} as rank 1 of 4" in result.stderr, result.stderr
    assert "Start the job with `ringrun -np 4 python ...`" in result.stderr


def _strategy(world_size: int = 1, **kwargs):
    """A RingFabricStrategy whose world is faked (no MPI in the test process)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from ringplug.fabric import RingFabricStrategy

    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    return RingFabricStrategy(cluster_environment=environment, **kwargs)


def test_backward_without_an_optimizer_set_up_is_refused_saying_what_to_pass():
    import torch

    strategy = _strategy(world_size=2)
    loss = torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum()
    with pytest.raises(RuntimeError, match=r"fabric.setup\(model, optimizer\)"):
        strategy.backward(loss, None)


def test_collectives_refuse_groups_and_unknown_ops_naming_what_to_use():
    import torch

    strategy = _strategy()
    with pytest.raises(ValueError, match="Leave group at its default"):
        strategy.all_reduce(torch.ones(2), group=object())
    with pytest.raises(ValueError, match="RingFabricStrategy.all_reduce: unsupported reduce_op"):
        strategy.all_reduce(torch.ones(2), reduce_op="median")


def test_devices_n_self_launches_n_ranks_each_on_the_gpu_of_its_local_rank(monkeypatch):
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.accelerators import cuda

    from ringplug.fabric.launcher import RingLauncher

    # Four GPUs, faked: Lightning counts them and lets accelerator="gpu" through.
    monkeypatch.setattr(cuda, "num_cuda_devices", lambda: 4)
    monkeypatch.setattr(cuda.CUDAAccelerator, "is_available", staticmethod(lambda: True))
    for key in [k for k in os.environ if k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_"))]:
        monkeypatch.delenv(key)
    fabric = Fabric(strategy=_strategy(), accelerator="gpu", devices=4)
    assert isinstance(fabric.strategy.launcher, RingLauncher)
    assert fabric.strategy.launcher.ranks == 4  # python train.py starts 4 ranks
    monkeypatch.setenv("LOCAL_RANK", "2")  # what rank 2 of them will see
    assert fabric.strategy.root_device == torch.device("cuda", 2)
    # A launcher that gave each rank one GPU (CUDA_VISIBLE_DEVICES per rank): that one.
    fabric = Fabric(strategy=_strategy(), accelerator="gpu", devices=[0])
    assert fabric.strategy.launcher is None
    assert fabric.strategy.root_device == torch.device("cuda", 0)
    assert Fabric(strategy=_strategy(), accelerator="cpu").strategy.root_device.type == "cpu"


ONE_JOB = str(Path(__file__).parent / "workers" / "in_turn.py")


@pytest.fixture(scope="module")
def one_job(tmp_path_factory):
    """Both Fabric namespaces in turn, in one 2-rank job: a script written for `fabric run`."""
    outdirs = {p: tmp_path_factory.mktemp(p.replace(".", "_")) for p in INTEGRATION}
    runs = []
    for package, outdir in outdirs.items():
        runs += ["+", "fabric_one_job.py", package, str(outdir)]
    result = run_ringrun("-np", "2", sys.executable, ONE_JOB, *runs[1:], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return {
        package: [json.loads((outdir / f"one_job-{r}.json").read_text()) for r in range(2)]
        for package, outdir in outdirs.items()
    }


@pytest.mark.multirank
@pytest.mark.parametrize("package", list(INTEGRATION))
def test_a_script_written_for_fabric_run_trains_as_one_job_under_ringrun(one_job, package):
    for rank, report in enumerate(one_job[package]):
        assert report["rank"] == rank
        trained = report["unchanged"]  # Fabric() with no arguments and no launch()
        assert trained["world_size"] == 2
        assert trained["strategy"] == "RingFabricStrategy"
        assert trained["sampler"] == "DistributedSampler"  # each rank its shard
        assert trained["parameters_equal"]
        # The script's own launch() is accepted once; a second is refused, saying why.
        assert report["launch_once"] is None
        assert "fabric.launch() was called a second time" in report["launch_twice"]


@pytest.mark.multirank
@pytest.mark.parametrize("package", list(INTEGRATION))
def test_fabric_keeps_buffers_within_ddps_bound_and_saves_the_same_model_on_every_rank(
    one_job, package
):
    for report in one_job[package]:
        kept = report["unchanged"]
        # DDP's bound: ranks differ by the last forward's update at most. Rank 0's buffers
        # travel during each backward here, so every step ends with no difference at all.
        assert kept["worst_excess_over_ddp_bound"] < 1e-5, kept
        assert kept["largest_gap"] == 0.0, kept
        # A training-mode forward without backward, then evaluation: it starts from rank 0's.
        assert kept["buffers_equal_when_evaluating"]
        assert kept["buffers_equal_after_save"]  # fabric.save sent rank 0's first
        # A parameter changed on one rank: the save after it stops every rank, naming it.
        assert kept["drift"].startswith("RanksDisagreeError"), kept["drift"]
        assert "'0.1.weight'" in kept["drift"], kept["drift"]
        apart = report["apart"]  # broadcast_buffers=False: each rank its own statistics
        assert apart["largest_gap"] > 1.0, apart
        assert not apart["buffers_equal_after_save"]
        assert not apart["buffers_equal_when_evaluating"]
        assert apart["parameters_equal"]


@pytest.mark.multirank
@pytest.mark.parametrize("package", list(INTEGRATION))
def test_under_ringrun_a_fabric_or_trainer_of_one_process_never_trains_a_copy_per_rank(
    one_job, package
):
    for report in one_job[package]:
        # Trainer(accelerator="cpu"): Lightning would pick one device; the ranks join the ring.
        assert report["trainer"] == ["RingStrategy", 2]
        # An explicit one-process strategy stops at once, saying what to change.
        refusal = report["single_device"]
        assert "started 2 ranks, but this Fabric trains in its own process alone" in refusal
        assert "Fabric(strategy='ring')" in refusal
        # devices that contradict the launcher's ranks: the one rule, said to a Fabric user.
        assert report["devices_3"].startswith("Fabric(devices=3, num_nodes=1) asks for 3 ranks")
