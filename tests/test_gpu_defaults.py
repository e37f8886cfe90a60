"""One GPU per rank by default: Lightning's devices="auto" under a launcher, the torch
backend and ringplug.torch.init(), ringplug.keras.init() on TensorFlow and JAX; and the
choices that contradict it. This machine has no GPU: the GPU counts are faked, the ranks
are real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

WORKERS = Path(__file__).parent / "workers"


# ------------------------------------------------------------------ the rule, on its own
def test_auto_on_four_gpu_hosts_gives_eight_ranks_one_gpu_each():
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from ringplug.fabric.devices import launched_devices

    every_gpu = [torch.device("cuda", i) for i in range(4)]
    # ringrun -np 8 -H a:4,b:4: local ranks 0..3 on each host.
    for local_rank in range(4):
        devices = launched_devices(
            every_gpu,
            visible_gpus=4,
            local_rank=local_rank,
            local_size=4,
            world_size=8,
            num_nodes=1,
        )
        assert devices[local_rank] == torch.device("cuda", local_rank)
    # Two ranks on a 4-GPU host use cuda:0 and cuda:1: the host's devices are those two.
    assert (
        launched_devices(
            every_gpu, visible_gpus=4, local_rank=1, local_size=2, world_size=2, num_nodes=1
        )
        == every_gpu[:2]
    )


def test_explicit_devices_that_match_the_launcher_are_kept():
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from ringplug.fabric.devices import launched_devices

    two = [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert (
        launched_devices(two, visible_gpus=4, local_rank=1, local_size=2, world_size=4, num_nodes=2)
        == two
    )
    # One rank per host may name its one GPU.
    assert launched_devices(
        [torch.device("cuda", 3)],
        visible_gpus=4,
        local_rank=0,
        local_size=1,
        world_size=2,
        num_nodes=1,
    )
    # On CPUs, devices=1 (Lightning's "auto" there) is one process per rank, as before.
    cpu = [torch.device("cpu")]
    assert (
        launched_devices(cpu, visible_gpus=0, local_rank=2, local_size=3, world_size=3, num_nodes=1)
        == cpu
    )


@pytest.mark.parametrize(
    ("devices", "visible", "local_rank", "local_size", "world", "nodes", "message"),
    [
        ([0, 1], 4, 0, 4, 4, 1, "asks for 2 ranks, but the MPI launcher started 4"),
        ([0], 4, 0, 4, 4, 1, r"name one GPU \(cuda:0\) for the 4 ranks"),
        ([0, 1, 2, 3], 4, 5, 6, 6, 1, "Local rank 5 has no GPU of its own"),
        ([0, 1, 2, 3], 4, 0, 4, 8, 3, "num_nodes=3"),
        ([1, 2], 4, 2, 3, 6, 3, "launcher started 3 ranks here"),
    ],
)
def test_devices_that_contradict_the_launcher_say_what_to_change(
    devices, visible, local_rank, local_size, world, nodes, message
):
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from ringplug.fabric.devices import launched_devices

    with pytest.raises(ValueError, match=message) as caught:
        launched_devices(
            [torch.device("cuda", i) for i in devices],
            visible_gpus=visible,
            local_rank=local_rank,
            local_size=local_size,
            world_size=world,
            num_nodes=nodes,
        )
    assert "ringrun" in str(caught.value) or "defaults" in str(caught.value)


def test_the_devices_rule_names_fabric_to_a_fabric_user():
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from ringplug.fabric.devices import launched_devices

    with pytest.raises(ValueError, match=r"^Fabric\(devices=2, num_nodes=1\) asks for 2 ranks"):
        launched_devices(
            [torch.device("cuda", 0), torch.device("cuda", 1)],
            visible_gpus=4,
            local_rank=0,
            local_size=4,
            world_size=4,
            num_nodes=1,
            owner="Fabric",
        )


def test_torch_takes_the_local_ranks_gpu_or_the_only_one():
    pytest.importorskip("torch")
    from ringplug.torch.device import local_gpu_index

    assert [local_gpu_index(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [local_gpu_index(r, 1) for r in range(3)] == [0, 0, 0]  # a GPU given per rank
    assert local_gpu_index(4, 4) is None  # none of its own: left alone, CPU work still runs
    assert local_gpu_index(0, 0) is None


def test_tensorflow_gpu_numbers_map_to_cuda_devices_after_the_pin(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    from ringplug.keras import _devices

    pinned = [tf.config.PhysicalDevice("/physical_device:GPU:2", "GPU")]
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind=None: pinned)
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: ["GPU:0"])
    _devices.physical_gpu.cache_clear()
    try:
        assert _devices.physical_gpu(0) == 2  # TensorFlow's GPU:0 is CUDA device 2
    finally:
        _devices.physical_gpu.cache_clear()


# ------------------------------------------------------------------ real ranks
@pytest.mark.multirank
def test_lightning_and_torch_take_the_local_ranks_gpu_on_three_ranks(tmp_path):
    pytest.importorskip("lightning")
    result = run_ringrun(
        "-np",
        "3",
        sys.executable,
        str(WORKERS / "gpu_defaults.py"),
        "lightning",
        str(tmp_path),
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(3):
        report = json.loads((tmp_path / f"lightning-{rank}.json").read_text())
        assert report["local_size"] == 3 and report["local_rank"] == rank
        mine = {"root": f"cuda:{rank}", "num_devices": 3, "world": 3}
        assert report["auto_by_name"] == mine  # strategy="ring", devices left at "auto"
        assert report["auto_instance"] == mine  # strategy=RingStrategy()
        assert "devices=2" in report["devices_2"] and "started 3" in report["devices_2"]
        assert "NCCL needs a GPU per rank" in report["devices_1"]
        assert "num_nodes=2" in report["num_nodes_2"]
        if rank < 2:  # a 2-GPU host: ranks 0 and 1 have one each ...
            assert report["two_gpus"] == {"root": f"cuda:{rank}", "num_devices": 2, "world": 3}
        else:  # ... and rank 2 is told it has none
            assert "Local rank 2 has no GPU of its own" in report["two_gpus"]
            assert "ringrun -H host:2" in report["two_gpus"]
        # One GPU visible per rank (CUDA_VISIBLE_DEVICES given per rank): each takes it.
        assert report["one_gpu_each"] == {"root": "cuda:0", "num_devices": 1, "world": 3}
        assert report["torch_init_queued"] == 1 and report["torch_init_device"] == [rank]
        assert report["torch_init_again_queued"] == 1
        assert report["backend_device"] == [rank]  # init_process_group("ringplug")
        assert report["user_chose_queued"] == 0  # CUDA already in use: left alone


@pytest.mark.multirank
def test_keras_init_pins_tensorflow_and_jax_to_the_local_ranks_gpu(tmp_path):
    pytest.importorskip("tensorflow")
    pytest.importorskip("jax")
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        str(WORKERS / "gpu_defaults.py"),
        "keras",
        str(tmp_path),
        extra_env={"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        report = json.loads((tmp_path / f"keras-{rank}.json").read_text())
        gpu = f"/physical_device:GPU:{rank}"
        assert report["tf_visible"] == [[gpu, "GPU"]]
        assert report["tf_growth"] == [[gpu, True]]
        assert "TensorFlow set up its GPUs" in report["tf_too_late"]
        assert "before any TensorFlow operation" in report["tf_too_late"]
        assert report["tf_pinned_by_hand"] == ""  # already this rank's GPU: accepted
        assert report["jax_pinned"] == rank and report["jax_flag"] == str(rank)
        assert report["jax_user_flag_kept"] is None  # a flag already set is not overridden
        assert "JAX set up its GPUs (4 GPUs)" in report["jax_too_late"]


def test_keras_distribution_and_ringplugs_optimizer_are_refused_together():
    pytest.importorskip("jax")
    pytest.importorskip("keras")
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    result = subprocess.run(
        [sys.executable, str(WORKERS / "keras_distribution.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["plain_fit"] == ""  # without a distribution, fit trains
    for case in ("made_under_distribution", "fit_under_distribution"):
        assert "two data-parallel mechanisms at once" in report[case]
        assert "DataParallel" in report[case] and "set_distribution" in report[case]


# ------------------------------------------------------------------ the GPU check's fits
CHECK_FITS = Path(__file__).parent / "gpu" / "check_fits.py"


@pytest.mark.parametrize(
    ("arguments", "needs"),
    [(["lightning"], "lightning"), (["keras", "--backend", "jax"], "jax")],
)
def test_the_gpu_checks_fits_pass_on_cpus(arguments, needs):
    # tests/gpu/check_gpu.sh runs these on the GPU; --device cpu runs the same fits here.
    pytest.importorskip(needs)
    pytest.importorskip("keras" if arguments[0] == "keras" else "lightning")
    result = subprocess.run(
        [sys.executable, str(CHECK_FITS), *arguments, "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [
        line
        for line in result.stdout.splitlines()
        if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")
    ]
    assert len(lines) == 2 and not any(line.startswith("FAIL") for line in lines), lines
    assert any(line.startswith("PASS") and "fit" in line for line in lines), lines


def test_the_gpu_checks_fits_refuse_unknown_arguments_with_the_choices():
    result = subprocess.run(
        [sys.executable, str(CHECK_FITS), "keras", "--backend", "mxnet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "jax" in result.stderr and "mxnet" in result.stderr


@pytest.mark.fakegpu
def test_check_gpu_sh_dry_run_passes_on_cpu_within_its_budget(tmp_path):
    # On CPU the steps that need a GPU are skipped; the two-rank script runs for real on the
    # MPI path (the same checks the GPU runs through NCCL), and so does a rank leaving.
    script = Path(__file__).parent / "gpu" / "check_gpu.sh"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    plan = subprocess.run(
        ["bash", str(script), "--plan"], capture_output=True, text=True, env=env, timeout=60
    )
    assert plan.returncode == 0, plan.stderr
    seconds = [int(line.split()[0]) for line in plan.stdout.splitlines() if " s  " in line]
    assert sum(seconds[:-1]) == seconds[-1] <= 400  # + 45 s of wheels: under 8 minutes
    result = subprocess.run(
        ["bash", str(script), "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    status = {step["name"]: step["status"] for step in report["steps"]}
    assert list(status)[:2] == ["nccl-mapped", "one-rank"]  # most informative first
    assert status.pop("two-ranks") == status.pop("two-ranks-exit-early") == "pass"
    assert set(status.values()) == {"skip"}
    two = next(step for step in report["steps"] if step["name"] == "two-ranks")
    assert len(two["checks"]) == 3 and all(line.startswith("PASS") for line in two["checks"])
