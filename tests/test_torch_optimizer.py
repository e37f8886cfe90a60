"""DistributedOptimizer on real ranks: N ranks x batch B train like 1 process x batch N*B."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKER = str(Path(__file__).parent / "workers" / "torch_optimizer.py")
STEPS = 5


def run(scenario: str, tmp_path: Path, ranks: int) -> list[dict]:
    result = run_ringrun("-np", str(ranks), sys.executable, WORKER, scenario, str(tmp_path),
                         timeout=180)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads((tmp_path / f"{scenario}-{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize(
    "scenario",
    ["plain", "accumulate", "clip", "fp16", "predivide", "unused"],
)
def test_ranks_train_like_one_process_on_the_union_of_their_batches(tmp_path, scenario, ranks):
    for report in run(scenario, tmp_path, ranks):
        assert report["matches_one_process"], report["max_difference"]
        assert report["ranks_identical"]
        # One bucket, one collective per optimizer step: accumulation sends nothing on the
        # first backward pass of each step, and unused parameters don't add collectives.
        assert report["collectives"] == STEPS
        assert not report["touched_nccl"]


def test_the_wrapper_keeps_the_optimizer_class_and_state():
    import ringplug
    import ringplug.torch as rpt

    ringplug.init()
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    wrapped = rpt.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    assert isinstance(wrapped, torch.optim.SGD)
    assert wrapped.param_groups[0]["lr"] == 0.5
    model(torch.ones(1, 3)).sum().backward()
    wrapped.step()
    assert model.weight.grad.tolist() == [[1.0] * 3] * 2  # one rank: the average is itself
    wrapped.zero_grad()
    assert model.weight.grad is None  # the next backward hands over fresh gradients


def test_named_parameters_must_cover_the_optimizer():
    import ringplug
    import ringplug.torch as rpt

    ringplug.init()
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="does not name 2 optimizer parameter"):
        rpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=other.named_parameters())  # fmt: skip


def test_a_world_of_one_reduces_nothing():
    import ringplug
    import ringplug.torch as rpt

    ringplug.init()
    engine = ringplug.core.runtime.engine()
    model = torch.nn.Linear(3, 2)
    optimizer = rpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = engine.collectives_run
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    optimizer.detach_hooks()  # nothing to detach, and harmless
    assert engine.collectives_run == before
    assert model.weight.grad.tolist() == [[1.0] * 3] * 2


@pytest.mark.parametrize("counts", ["6,4", "4,6,5"])
def test_join_lets_ranks_with_more_batches_finish_with_zeros_from_the_others(tmp_path, counts):
    worker = str(Path(__file__).parent / "workers" / "torch_join.py")
    ranks = len(counts.split(","))
    result = run_ringrun("-np", str(ranks), sys.executable, worker, counts, str(tmp_path),
                         timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    longest = max(range(ranks), key=lambda r: int(counts.split(",")[r]))
    for rank in range(ranks):
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        assert report["last"] == longest  # the same on every rank
        assert report["max_difference"] < 1e-5, report
        assert report["ranks_identical"]
