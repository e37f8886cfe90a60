"""RingStrategy under ringrun: Lightning trains like one process on the union of batches.

The key scenarios run in both Lightning namespaces: ``lightning.pytorch`` (with
`ringplug.lightning`) and the standalone ``pytorch_lightning`` (with `ringplug.pytorch_lightning`,
the same files mirrored); the workers pick theirs from ``TEST_LIGHTNING_PACKAGE``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import helpers_left, processes_matching, run_ringrun, unique_marker

pytest.importorskip("lightning")
pytestmark = pytest.mark.multirank

IN_TURN = str(Path(__file__).parent / "workers" / "in_turn.py")
STEPS = 6


def in_package(package: str) -> dict[str, str]:
    """The environment that makes a worker train with `package`'s Lightning."""
    return {"TEST_LIGHTNING_PACKAGE": package}


# Each Lightning package's 2-rank scenarios share one job (workers/in_turn.py runs the
# workers one after the other in the same ranks): Lightning is imported once per rank, not
# once per scenario. Each test reads its own scenario's reports, so a failure still names
# the scenario; a failed job fails each of its tests with the job's output.
# What each package fits (lightning_fit.py): "compiled" goes last, so that what
# torch.compile leaves set up in the process touches no fit after it.
FITS = {
    "lightning": ["buffers", "plain", "accumulate", "by-name", "clip", "batchnorm", "compiled"],
    "pytorch_lightning": ["plain", "by-name"],
}
# The other workers in the job, for the packages they are tested in, each with the fixture
# that reads it: it runs only where a test that asks for that fixture was collected.
PARTS = {
    "lifecycle": ["lightning"],
    "extras": ["lightning"],
    "cli_reports": ["lightning", "pytorch_lightning"],
}


def cli_config(package: str, outdir: Path) -> Path:
    """A LightningCLI YAML choosing RingStrategy by class path with arguments; the workers'
    Report callback writes into `outdir`."""
    integration = "ringplug.lightning" if package == "lightning" else "ringplug.pytorch_lightning"
    config = outdir / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n  max_steps: 3\n  logger: false\n  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n  enable_model_summary: false\n"
        "  strategy:\n"
        f"    class_path: {integration}.RingStrategy\n"
        "    init_args:\n      compression: fp16\n      bucket_bytes: 1048576\n"
        "  callbacks:\n"
        "    - class_path: __main__.Report\n"
        f"      init_args:\n        outdir: {outdir}\n"
    )
    return config


@pytest.fixture(scope="module")
def job(request, tmp_path_factory):
    """``job(package)``: the folder of that package's shared job, once it has passed, with a
    subfolder per worker (fit, lifecycle, extras, cli)."""
    used = {
        name
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        for name in getattr(item, "fixturenames", ())
    }
    jobs: dict[str, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def folder(package: str) -> Path:
        if package not in jobs:
            outdir = tmp_path_factory.mktemp(f"job-{package}")
            for part in ("fit", "lifecycle", "extras", "cli"):
                (outdir / part).mkdir()
            runs = [["lightning_fit.py", ",".join(FITS[package]), str(outdir / "fit")]]
            for fixture, script in (
                ("lifecycle", "lightning_lifecycle.py"),
                ("extras", "lightning_extras.py"),
            ):
                if fixture in used and package in PARTS[fixture]:
                    runs.append([script, str(outdir / fixture)])
            if (
                "cli_reports" in used
                and package in PARTS["cli_reports"]
                and importlib.util.find_spec("jsonargparse")
            ):
                config = cli_config(package, outdir / "cli")
                runs.append(["lightning_cli.py", "fit", "--config", str(config)])
            arguments = [arg for run in runs for arg in ("+", *run)][1:]
            result = run_ringrun(
                "-np",
                "2",
                sys.executable,
                IN_TURN,
                *arguments,
                extra_env=in_package(package),
                timeout=480,
            )
            jobs[package] = (result, outdir)
        result, outdir = jobs[package]
        assert result.returncode == 0, result.stdout + result.stderr
        return outdir

    return folder


@pytest.fixture(scope="module")
def fit(job):
    """``fit(scenario, package)``: each rank's report of that scenario."""

    def reports(scenario: str, package: str = "lightning") -> list[dict]:
        assert scenario in FITS[package], f"add {scenario!r} to FITS[{package!r}]"
        outdir = job(package) / "fit"
        return [json.loads((outdir / f"{scenario}-{r}.json").read_text()) for r in range(2)]

    return reports


def test_buffers_are_rank_zeros_on_every_rank_after_fit(fit):
    # Plain BatchNorm: each rank's batch moves its own running statistics; as DDP does,
    # RingStrategy hands rank 0's to every rank, so all evaluate and save one model.
    reports = fit("buffers")
    assert all(report["buffers_identical"] for report in reports)
    assert all(report["ranks_identical"] for report in reports)


@pytest.mark.parametrize(
    ("package", "scenario"),
    [
        *(("lightning", s) for s in ["plain", "by-name", "clip", "batchnorm", "compiled"]),
        # pl.Trainer(strategy=RingStrategy()) and pl.Trainer(strategy="ring")
        ("pytorch_lightning", "plain"),
        ("pytorch_lightning", "by-name"),
    ],
)
def test_fit_on_two_ranks_matches_one_process_on_the_union_of_batches(fit, package, scenario):
    for report in fit(scenario, package):
        assert report["strategy"] == "RingStrategy"
        assert report["strategy_of_this_lightning"]  # a Strategy of the Trainer's package
        assert not report["other_lightning_imported"]
        assert report["sampler_replicas"] == 2  # Lightning added the distributed sampler
        assert report["matches_one_process"], report["max_difference"]
        assert report["ranks_identical"]
        assert report["logged_equal"]  # self.log(..., sync_dist=True) reduced over ranks
        assert report["norms_equal"]  # on_after_backward already saw averaged gradients
        # 2 ranks on this host share its cores instead of each using all of them.
        assert report["torch_threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
        if scenario == "batchnorm":  # synchronized while fitting, the original class after
            assert report["layer_types"] == ["BatchNorm1d", "Linear", "Tanh"]
        # trainer.fit(torch.compile(model)) trains the compiled forward, as under DDP
        assert report["compiled"] == (scenario == "compiled")


def test_accumulated_batches_send_gradients_once_per_optimizer_step(fit):
    # Both fits ran in one process; each report counts the collectives of its own fit.
    plain = fit("plain")
    accumulated = fit("accumulate")
    for report in accumulated:
        assert report["matches_one_process"], report["max_difference"]
        assert report["ranks_identical"]
    # Same logging and set-up collectives; half as many gradient reductions.
    assert plain[0]["collectives"] - accumulated[0]["collectives"] == STEPS // 2


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
@pytest.mark.parametrize("ringplug_first", [True, False], ids=["ringplug-first", "lightning-first"])
def test_strategy_ring_works_after_importing_ringplug_in_either_order(package, ringplug_first):
    imports = ["import ringplug", f"import {package} as L"]
    other = "pytorch_lightning" if package == "lightning" else "lightning"
    code = "\n".join(
        [
            *(imports if ringplug_first else imports[::-1]),
            "import sys",
            "trainer = L.Trainer(strategy='ring', accelerator='cpu', logger=False)",
            "strategy = type(trainer.strategy)",
            f"print(strategy.__module__, strategy.__name__, {other!r} in sys.modules)",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    integration = "ringplug.lightning" if package == "lightning" else "ringplug.pytorch_lightning"
    # The Trainer's own package's strategy, and no import of the other Lightning.
    assert result.stdout.strip().splitlines()[-1] == f"{integration}.strategy RingStrategy False"


def test_pytorch_lightning_strategy_is_built_on_pytorch_lightning_classes_alone():
    code = (
        "import sys, pytorch_lightning as pl, lightning_fabric\n"
        "from pytorch_lightning.strategies.launchers.launcher import _Launcher\n"
        "from ringplug.pytorch_lightning import RingEnvironment, RingStrategy, RingSyncBatchNorm\n"
        "from ringplug.pytorch_lightning.launcher import RingLauncher\n"
        "print(issubclass(RingStrategy, pl.strategies.ParallelStrategy),\n"
        "      issubclass(RingEnvironment, lightning_fabric.plugins.ClusterEnvironment),\n"
        "      issubclass(RingSyncBatchNorm, pl.plugins.LayerSync),\n"
        "      issubclass(RingLauncher, _Launcher),\n"
        "      sorted(m for m in ('lightning', 'ringplug.lightning', 'ringplug.fabric')\n"
        "             if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True True True True []"


def test_importing_ringplug_alone_does_not_import_lightning():
    code = "import sys, ringplug\nprint('lightning' in sys.modules, 'torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False False"


@pytest.fixture(scope="module")
def lifecycle(job) -> list[dict]:
    outdir = job("lightning") / "lifecycle"
    return [json.loads((outdir / f"lifecycle-{r}.json").read_text()) for r in range(2)]


def test_early_stopping_stops_every_rank_at_the_same_epoch(lifecycle):
    # Only rank 1's (unsynced) signal asks to stop; the decision is shared.
    assert [report["stopped_epoch"] for report in lifecycle] == [1, 1]
    assert [report["is_global_zero"] for report in lifecycle] == [True, False]


def test_checkpoints_are_written_once_and_resume_keeps_ranks_identical(lifecycle):
    for report in lifecycle:
        assert report["checkpoints"] == ["epoch=0-step=5.ckpt", "last.ckpt"]
        assert report["resumed_identical"]
        assert report["resumed_epochs"] == 3


def test_ranks_that_drift_apart_stop_at_the_checkpoint_naming_the_first_parameter(lifecycle):
    # Every other fit here checks at its checkpoints too, and agrees.
    for report in lifecycle:
        drift = report["drift"]
        assert drift["tensor"] == "layer.weight" and drift["groups"] == [[0], [1]]
        assert "disagree at the checkpoint of step 5 on 'layer.weight'" in drift["message"]
        assert drift["written"] == ["epoch=0-step=5.ckpt"]  # rank 0's, to resume from


def test_validate_and_test_report_the_same_synced_values_on_every_rank(lifecycle):
    assert lifecycle[0]["val_loss"] == lifecycle[1]["val_loss"]
    assert lifecycle[0]["validate"] == lifecycle[1]["validate"]
    assert lifecycle[0]["test"] == lifecycle[1]["test"]


def test_predict_gives_each_rank_its_own_shard_of_the_data(lifecycle):
    ids = [set(report["predicted_ids"]) for report in lifecycle]
    assert not ids[0] & ids[1]
    assert ids[0] | ids[1] == set(range(40))


SELF_LAUNCH = str(Path(__file__).parent / "workers" / "lightning_selflaunch.py")


def test_python_train_py_with_devices_runs_that_many_ranks_of_one_world():
    result = subprocess.run(
        [sys.executable, SELF_LAUNCH, "2"], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "fitted" in line)
    assert lines == ["[0] fitted rank=0 size=2 world=2", "[1] fitted rank=1 size=2 world=2"]


def test_a_self_launched_job_exits_with_the_failing_ranks_status(tmp_path):
    marker = unique_marker("self-launch-fail")
    # Every rank starts helper processes (tests/workers/children.py), which must end too.
    result = subprocess.run(
        [sys.executable, SELF_LAUNCH, "2", "fail", marker, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode != 0
    assert "rank 1 fails during training" in result.stdout + result.stderr
    assert "ringrun: rank 1 " in result.stderr
    assert processes_matching(marker) == []
    assert len(list(tmp_path.glob("children.0.?"))) == 2
    assert helpers_left(tmp_path, bound_s=10.0) == []


def test_devices_that_contradict_the_launcher_are_an_error_naming_both():
    result = run_ringrun("-np", "2", sys.executable, SELF_LAUNCH, "3", timeout=240)
    assert result.returncode != 0
    assert "devices=3" in result.stdout + result.stderr
    assert "the MPI launcher started 2" in result.stdout + result.stderr


@pytest.fixture(scope="module")
def extras(job) -> list[dict]:
    outdir = job("lightning") / "extras"
    return [json.loads((outdir / f"extras-{r}.json").read_text()) for r in range(2)]


def test_manual_optimization_two_optimizers_loader_workers_and_torchmetrics(extras):
    for report in extras:
        assert report["trained"] and report["ranks_identical"]
        # torchmetrics summed each rank's half of the ids through the torch.distributed group.
        assert report["ids_total"] == report["expected_total"]


CLI = str(Path(__file__).parent / "workers" / "lightning_cli.py")


@pytest.fixture(scope="module")
def cli_reports(job):
    """``cli_reports(package)``: each rank's report of lightning_cli.py fit --config."""

    def reports(package: str) -> list[dict]:
        pytest.importorskip("jsonargparse")
        outdir = job(package) / "cli"
        return [json.loads((outdir / f"cli-{r}.json").read_text()) for r in range(2)]

    return reports


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_cli_yaml_selects_ring_strategy_with_its_arguments(cli_reports, package):
    integration = "ringplug.lightning" if package == "lightning" else "ringplug.pytorch_lightning"
    for report in cli_reports(package):
        assert report["strategy"] == f"{integration}.strategy.RingStrategy"
        assert report["compression"] == "Compression.fp16"
        assert report["bucket_bytes"] == 1048576
        assert report["world_size"] == 2 and report["steps"] == 3
        assert report["ranks_identical"]


# What the command-line tests give `lightning_cli.py fit ... --print_config`: one process runs
# them in turn (workers/in_turn.py; Lightning imported once), the refused one last.
PRINTS = {
    "class-path": ["--trainer.strategy.class_path=ringplug.lightning.RingStrategy"],
    "every-argument": [
        "--trainer.strategy=ringplug.lightning.RingStrategy",
        "--trainer.strategy.timeline=/tmp/trace.json",
    ],
    "gzip": [
        "--trainer.strategy=ringplug.lightning.RingStrategy",
        "--trainer.strategy.compression=gzip",
    ],
}


def in_turn_part(stream: str, index: int) -> str | None:
    """What run `index` of an in_turn process wrote on `stream`: the text from its marker to
    the next run's (or the end); None if the run did not begin."""
    begins = [re.search(rf"^in_turn: {i} \S+ begins$", stream, re.M) for i in (index, index + 1)]
    if begins[0] is None:
        return None
    return stream[begins[0].end() : begins[1].start() if begins[1] else len(stream)]


@pytest.fixture(scope="module")
def printed() -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The process that ran each of PRINTS in turn, and the names in the order they ran."""
    pytest.importorskip("jsonargparse")
    names = list(PRINTS)
    arguments = [a for name in names for a in ("+", CLI, "fit", *PRINTS[name], "--print_config")]
    result = subprocess.run(
        [sys.executable, IN_TURN, *arguments[1:]],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    return result, names


def printed_strategy(printed, name: str) -> dict:
    """The strategy's part of ``lightning_cli.py fit PRINTS[name] --print_config``."""
    yaml = pytest.importorskip("yaml")
    result, names = printed
    index = names.index(name)
    # It exited with 0 if the next one began.
    assert in_turn_part(result.stdout, index + 1) is not None, result.stdout + result.stderr
    return yaml.safe_load(in_turn_part(result.stdout, index))["trainer"]["strategy"]


def test_lightning_cli_takes_ring_strategy_by_class_path_on_the_command_line(printed):
    # `--trainer.strategy=ringplug.lightning.RingStrategy` alone is a strategy *name* to
    # LightningCLI (the Trainer takes str or Strategy); docs/lightning.md gives this form.
    strategy = printed_strategy(printed, "class-path")
    assert strategy["class_path"] == "ringplug.lightning.RingStrategy"


def test_lightning_cli_print_config_shows_every_ring_strategy_argument(printed):
    strategy = printed_strategy(printed, "every-argument")
    assert strategy["class_path"] == "ringplug.lightning.RingStrategy"
    assert strategy["init_args"]["timeline"] == "/tmp/trace.json"
    assert {
        "compression",
        "gradient_predivide_factor",
        "bucket_bytes",
        "timeline",
        "cluster_environment",
    } <= set(strategy["init_args"])


def test_lightning_cli_rejects_an_unknown_compression_naming_the_choices(printed):
    result, names = printed
    assert names[-1] == "gzip"  # the last: the process ends with its exit status
    stderr = in_turn_part(result.stderr, names.index("gzip"))
    assert result.returncode != 0
    assert stderr is not None, result.stdout + result.stderr
    assert "gzip" in stderr and "fp16" in stderr


def test_unsupported_accelerators_are_refused_with_what_to_use_instead():
    import torch

    from ringplug.lightning import RingStrategy

    strategy = RingStrategy(parallel_devices=[torch.device("mps", 0)])
    with pytest.raises(NotImplementedError, match="accelerator='gpu'"):
        strategy._configure_launcher()


def test_each_rank_trains_on_the_gpu_of_its_local_rank(monkeypatch):
    import torch
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from ringplug.lightning import RingStrategy

    monkeypatch.setenv("LOCAL_RANK", "2")
    gpus = [torch.device("cuda", i) for i in range(4)]
    strategy = RingStrategy(parallel_devices=gpus, cluster_environment=LightningEnvironment())
    assert strategy.root_device == torch.device("cuda", 2)
    # A launcher that gives each rank one GPU (CUDA_VISIBLE_DEVICES per rank): device 0.
    strategy = RingStrategy(
        parallel_devices=[torch.device("cuda", 0)], cluster_environment=LightningEnvironment()
    )
    assert strategy.root_device == torch.device("cuda", 0)
    assert RingStrategy(parallel_devices=[torch.device("cpu")]).root_device.type == "cpu"
