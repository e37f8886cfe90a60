"""RingStrategy(zero=1/2) on real ranks: sharded optimizer state trains as zero=0 does.

One ringrun job per world size fits every case (workers/lightning_zero.py); the 3-rank job
runs first and leaves a checkpoint that the 2-rank job resumes from, and that one process
with a plain Trainer (ringplug not imported) resumes from too. The names, LightningCLI
configs and refusals that need no ranks run in one process of their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "lightning_zero.py")
CASES = ["adam", "clip-norm", "clip-value", "accumulate", "bf16", "manual"]
QUIET = {"RINGPLUG_DIAGNOSE": "0"}  # no step-time report after each of the 30-odd fits


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """``job(ranks)``: (folder, each rank's report) of the job of that many ranks, once it
    has passed; the 2-rank job resumes from the 3-rank job's checkpoint."""
    jobs: dict[int, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def run(ranks: int) -> tuple[Path, list[dict]]:
        if ranks not in jobs:
            outdir = tmp_path_factory.mktemp(f"lightning-zero-{ranks}")
            extra = [str(run(3)[0] / "resume.ckpt")] if ranks == 2 else []
            result = run_ringrun(
                "-np", str(ranks), sys.executable, WORKER, "job", str(outdir), *extra,
                extra_env=QUIET, timeout=480,
            )  # fmt: skip
            jobs[ranks] = (result, outdir)
        result, outdir = jobs[ranks]
        assert result.returncode == 0, result.stdout + result.stderr
        reports = [json.loads((outdir / f"zero-{r}.json").read_text()) for r in range(ranks)]
        return outdir, reports

    return run


@pytest.mark.parametrize("ranks", [3, 2])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_sharded_fit_ends_where_the_unsharded_fit_does(job, case, zero, ranks):
    for report in job(ranks)[1]:
        result = report[f"{case}-zero{zero}"]
        assert result["relative_difference"] <= 1e-6, result
        assert result["ranks_identical"]
        assert result["strategy"] == f"RingStrategy(zero={zero})"
        assert result["steps"] == (40 if case == "manual" else 20)  # two optimizers step


@pytest.mark.parametrize("ranks", [3, 2])
def test_the_unsharded_fit_is_one_process_on_the_whole_batch(job, ranks):
    # What makes the comparisons above worth having: every rank count trains the same steps.
    for report in job(ranks)[1]:
        assert report["adam-zero0"]["relative_difference"] <= 1e-6, report["adam-zero0"]
        assert report["adam-zero0"]["ranks_identical"]


@pytest.mark.parametrize("ranks", [3, 2])
@pytest.mark.parametrize("case", ["clip-norm", "clip-value"])
def test_clipping_clipped_every_step(job, case, ranks):
    # The unsharded fit saw every gradient: above the bound at each of the 20 steps, so the
    # sharded fits matched it only by clipping alike (with zero=2, by the norm of every shard).
    bound = 0.05 if case == "clip-norm" else 0.002
    for report in job(ranks)[1]:
        seen = report[f"{case}-zero2"]["unsharded_before_clipping"]
        assert len(seen) == 20 and min(seen) > bound


@pytest.mark.parametrize("ranks", [3, 2])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("case", [c for c in CASES if c != "manual"])
def test_each_rank_holds_its_share_of_the_optimizer_state(job, case, zero, ranks):
    for report in job(ranks)[1]:
        result = report[f"{case}-zero{zero}"]
        assert 0 < result["state_bytes"] <= result["unsharded_state_bytes"] / ranks * 1.05
        if zero == 2:  # and of the averaged gradients
            assert 0 < result["grad_bytes"] <= result["unsharded_grad_bytes"] / ranks * 1.05
        else:
            assert result["grad_bytes"] == result["unsharded_grad_bytes"]


@pytest.mark.parametrize("ranks", [3, 2])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_every_state_tensor_is_held_by_exactly_one_rank(job, case, zero, ranks):
    # Also with two optimizers (manual), each dealing its own few tensors out whole, where
    # the shares are as even as whole tensors allow (up to 14% over 1/3 here), not 1/p.
    results = [report[f"{case}-zero{zero}"] for report in job(ranks)[1]]
    assert sum(r["state_bytes"] for r in results) == results[0]["unsharded_state_bytes"]
    assert all(r["state_bytes"] < r["unsharded_state_bytes"] for r in results)
    if zero == 2:
        assert sum(r["grad_bytes"] for r in results) == results[0]["unsharded_grad_bytes"]


@pytest.mark.parametrize("ranks", [3, 2])
def test_the_checkpoint_holds_the_whole_optimizer_state(job, ranks):
    outdir, _ = job(ranks)
    sharded = torch.load(outdir / f"adam-zero2-{ranks}.ckpt", weights_only=False)
    unsharded = torch.load(outdir / f"adam-zero0-{ranks}.ckpt", weights_only=False)
    (state,), (expected,) = sharded["optimizer_states"], unsharded["optimizer_states"]
    assert len(expected["state"]) == 16  # 8 layers, weight and bias
    assert sorted(state["state"]) == sorted(expected["state"])
    for index, values in expected["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(state["state"][index][key], values[key], rtol=1e-5, atol=1e-9)
    assert state["param_groups"] == expected["param_groups"]  # lr after the schedule too


def test_a_fit_saved_on_3_ranks_resumes_on_2(job):
    for report in job(2)[1]:
        resumed = report["resumed"]
        assert resumed["steps"] == 20
        assert resumed["relative_difference"] <= 1e-6, resumed  # as the uninterrupted fit
        assert resumed["ranks_identical"]
        # Loading gave each rank its shard of the whole state in the checkpoint.
        assert 0 < resumed["state_bytes"] <= resumed["unsharded_state_bytes"] / 2 * 1.05


def test_a_plain_trainer_in_one_process_resumes_the_sharded_checkpoint(job, tmp_path):
    outdir, _ = job(3)
    result = subprocess.run(
        [sys.executable, WORKER, "plain", str(outdir / "resume.ckpt"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    plain = torch.load(tmp_path / "plain.pt")
    assert not plain["ringplug_imported"]
    assert plain["strategy"] == "SingleDeviceStrategy" and plain["optimizer_class"] == "Adam"
    assert plain["steps"] == 20
    uninterrupted = torch.load(outdir / "uninterrupted-3.pt")
    difference = (plain["flat"] - uninterrupted).abs().max() / uninterrupted.abs().max()
    assert difference <= 1e-6


@pytest.mark.parametrize("ranks", [3, 2])
def test_lbfgs_is_refused_with_what_to_use_instead(job, ranks):
    for report in job(ranks)[1]:
        assert "LBFGS cannot be sharded" in report["lbfgs_refused"]
        assert "zero=0" in report["lbfgs_refused"]


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """What `lightning_zero.py alone` found, in one process with no ranks."""
    outdir = tmp_path_factory.mktemp("lightning-zero-alone")
    result = subprocess.run(
        [sys.executable, WORKER, "alone", str(outdir)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((outdir / "alone.json").read_text())


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_ring_zero1_and_ring_zero2_are_registered_names(alone, package):
    integration = "ringplug.lightning" if package == "lightning" else "ringplug.pytorch_lightning"
    for zero, name in enumerate(["ring", "ring_zero1", "ring_zero2"]):
        assert alone["names"][f"{package}:{name}"] == [f"{integration}.strategy", zero]


def test_lightning_cli_configs_choose_a_stage_by_name_or_by_argument(alone):
    assert alone["cli"]["by-name"] == ["RingStrategy", 2]  # strategy: ring_zero2
    assert alone["cli"]["class-path"] == ["RingStrategy", 1]  # init_args: {zero: 1}
    assert "zero" in alone["cli_zero_3"] and "Literal[0, 1, 2]" in alone["cli_zero_3"]


def test_a_stage_that_does_not_exist_is_refused(alone):
    for key in ("zero_3", "zero_true"):
        assert "must be 0 (no sharding), 1" in alone[key]
    assert alone["zero_3"].endswith("got 3.") and alone["zero_true"].endswith("got True.")


def test_zero2_with_compressed_gradients_is_refused_and_zero1_takes_them(alone):
    assert "use zero=1 with compression='fp16'" in alone["zero2_fp16"]
    assert alone["zero1_fp16"] is None


def test_zero2_with_a_gradient_scaler_is_refused_and_zero1_trains(alone):
    assert alone["world"] == 1
    assert "cannot run with a gradient scaler" in alone["scaler_zero2"]
    assert "Use zero=1, or precision='bf16-mixed'" in alone["scaler_zero2"]
    assert alone["scaler_zero1"] is None


def test_an_unregistered_ring_zero_name_gets_ringruns_hint():
    # A config naming the stage while nothing imported ringplug: Lightning's own error says
    # only that the name is unknown; ringrun's hint says how to name the class instead.
    from ringplug.run.launch.hints import RING_NOT_REGISTERED, hint_for

    for name in ("ring_zero1", "ring_zero2"):
        line = f"ValueError: You selected an invalid strategy name: `strategy='{name}'`. It must"
        assert hint_for(line) == RING_NOT_REGISTERED
    assert "`zero: 1` or `2`" in RING_NOT_REGISTERED
    assert hint_for("invalid strategy name: `strategy='ring_zero3'`. It must be") is None
