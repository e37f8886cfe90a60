"""Where in training each rank is: the phase a rank reports carries its epoch, batch and step.

`ringplug.core.activity` words the position into the phase it sends (at most 255 bytes);
RingStrategy sets it at each training batch, RingBroadcast at each Keras batch, and
DistributedOptimizer counts its steps, so a stall report names the batch of a missing rank.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from launch import run_ringrun
from ringplug.core import activity
from ringplug.core.engine.exchange import decode, encode
from ringplug.wire import Message

WORKER = str(Path(__file__).parent / "workers" / "positions.py")
HELD = "at epoch 1, batch 3 (step 9)"  # where the worker holds rank 1 (6 batches an epoch)


@pytest.fixture(autouse=True)
def fresh_activity():
    activity.set_phase("")
    activity.set_position()
    yield
    activity.set_phase("")
    activity.set_position()


def phase() -> str:
    return activity.current()[0]


def on_the_wire(activities: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """The activities as peers receive them, through the compact form of a message."""
    return [decode(encode(Message(1, activity=a))).activity for a in activities]


# ---------------------------------------------------------------------- the phase's words
def test_the_position_follows_the_phase():
    activity.set_phase(activity.COMPUTING)
    activity.set_position(epoch=0, batch=17, step=17)
    assert phase() == "in forward/backward at epoch 0, batch 17 (step 17)"


def test_a_new_position_replaces_the_last_one():
    activity.set_phase(activity.COMPUTING)
    activity.set_position(epoch=0, batch=5, step=5)
    assert phase().endswith("at epoch 0, batch 5 (step 5)")
    activity.set_position(epoch=1, batch=0, step=6)
    assert phase() == "in forward/backward at epoch 1, batch 0 (step 6)"


def test_a_new_phase_keeps_the_position():
    activity.set_position(epoch=2, batch=1, step=13)
    activity.set_phase(activity.REDUCING)
    assert phase() == "waiting for gradient reduction at epoch 2, batch 1 (step 13)"


def test_moving_to_the_next_batch_does_not_restart_the_phase_clock():
    activity.set_phase(activity.WAITING_FOR_DATA)
    time.sleep(0.06)  # time passing is what is measured here
    activity.set_position(epoch=0, batch=1, step=1)
    assert activity.current()[1] >= 0.05


def test_forgetting_the_position_leaves_the_bare_phase():
    activity.set_phase(activity.BETWEEN_STEPS)
    activity.set_position(epoch=0, batch=3, step=3)
    activity.set_position()
    assert phase() == "between steps"


def test_only_the_known_parts_of_a_position_are_named():
    activity.set_phase(activity.COMPUTING)
    activity.set_position(step=5)
    assert phase() == "in forward/backward at step 5"
    activity.set_position(epoch=2)
    assert phase() == "in forward/backward at epoch 2"
    activity.set_position(epoch=2, step=12)
    assert phase() == "in forward/backward at epoch 2 (step 12)"
    activity.set_position(epoch=2, batch=0)
    assert phase() == "in forward/backward at epoch 2, batch 0"


def test_no_phase_is_no_phase_whatever_the_position():
    activity.set_position(epoch=0, batch=3, step=3)
    assert phase() == ""


def test_a_counted_step_goes_up_by_one_and_keeps_epoch_and_batch():
    activity.set_phase(activity.BETWEEN_STEPS)
    activity.count_step()
    activity.count_step()
    assert phase() == "between steps at step 2"
    activity.set_position(epoch=0, batch=3, step=3)
    activity.count_step()
    assert phase() == "between steps at epoch 0, batch 3 (step 4)"


def test_a_long_phase_is_cut_so_that_its_position_is_still_sent():
    activity.set_phase("in a step named " + "é" * 200)
    activity.set_position(epoch=0, batch=17, step=17)
    words = phase()
    assert len(words.encode()) <= activity.MAX_BYTES
    assert words.startswith("in a step named é")
    (received, _), *_ = on_the_wire([activity.current()])
    assert received == words and received.endswith(" at epoch 0, batch 17 (step 17)")


def test_a_stall_report_quotes_the_missing_ranks_position():
    activity.set_phase(activity.COMPUTING)
    activity.set_position(epoch=0, batch=3, step=3)
    mine = activity.current()
    activities = on_the_wire([("", 0.0), (mine[0], 12.4)])
    assert activity.describe([1], activities, {}) == (
        "rank 1 was in forward/backward at epoch 0, batch 3 (step 3) for 12 s"
    )
    assert activity.describe([1], activities, {"other": [1]}) == (
        "rank 1 waits in a different collective ('other'; last phase: in forward/backward "
        "at epoch 0, batch 3 (step 3))"
    )


def test_distributed_optimizer_counts_its_steps_into_the_position():
    torch = pytest.importorskip("torch")
    import ringplug
    import ringplug.torch as rpt

    ringplug.init()  # a world of one
    model = torch.nn.Linear(3, 1)
    optimizer = rpt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for _ in range(3):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert phase() == "between steps at step 3"


# ---------------------------------------------------------------------- real ranks
def held_fit(scenario: str, outdir: Path, **env: str) -> dict:
    """Run the worker on 2 ranks: what rank 0 warned while rank 1 held, and the reports."""
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        WORKER,
        scenario,
        str(outdir),
        extra_env={"RINGPLUG_STALL_CHECK_SECONDS": "0.5", "RINGPLUG_TIMEOUT": "60", **env},
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    stall = outdir / "stall.txt"
    assert stall.exists(), result.stdout + result.stderr
    reports = [json.loads((outdir / f"{scenario}-{r}.json").read_text()) for r in range(2)]
    return {"warnings": stall.read_text(), "reports": reports}


@pytest.fixture(scope="module")
def lightning_fit(tmp_path_factory) -> dict:
    pytest.importorskip("lightning")
    return held_fit("lightning", tmp_path_factory.mktemp("positions-lightning"))


@pytest.fixture(scope="module", params=["tensorflow", "torch"])
def keras_fit(request, tmp_path_factory) -> dict:
    pytest.importorskip("keras")
    pytest.importorskip(request.param)
    outdir = tmp_path_factory.mktemp(f"positions-keras-{request.param}")
    return held_fit("keras", outdir, KERAS_BACKEND=request.param, TF_CPP_MIN_LOG_LEVEL="3")


@pytest.mark.multirank
def test_lightning_stall_report_names_the_epoch_batch_and_step_of_the_held_rank(lightning_fit):
    warnings = lightning_fit["warnings"]
    assert "'gradients.0.0' is ready on rank(s) 0 but not on rank(s) 1" in warnings, warnings
    assert f"rank 1 was in forward/backward {HELD} for" in warnings, warnings


@pytest.mark.multirank
def test_lightning_position_is_forgotten_when_the_fit_ends(lightning_fit):
    for report in lightning_fit["reports"]:
        assert " at " not in report["phase after fit"], report


@pytest.mark.multirank
def test_keras_stall_report_names_the_epoch_batch_and_step_of_the_held_rank(keras_fit):
    warnings = keras_fit["warnings"]
    assert "is ready on rank(s) 0 but not on rank(s) 1" in warnings, warnings
    assert f"rank 1 was in the train step {HELD} for" in warnings, warnings


@pytest.mark.multirank
def test_keras_position_is_forgotten_when_the_fit_ends(keras_fit):
    for report in keras_fit["reports"]:
        assert " at " not in report["phase after fit"], report
