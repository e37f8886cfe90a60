"""DistributedOptimizer on real ranks: N ranks x batch B train like 1 process x batch N*B."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.multirank

WORKERS = Path(__file__).parent / "workers"
STEPS = 5


SCENARIOS = ["plain", "accumulate", "clip", "fp16", "predivide", "unused"]
JOIN_COUNTS = {2: "6,4", 3: "4,6,5"}  # each rank's number of batches in the join test


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """``job(ranks)``: the folder of the job of that many ranks, once it has passed. It runs
    every optimizer scenario, then the join worker with JOIN_COUNTS[ranks], in the same
    ranks (workers/in_turn.py: torch is imported once per rank); each writes into a
    subfolder of its own. A failed job fails each of its tests with the job's output."""
    jobs: dict[int, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def folder(ranks: int) -> Path:
        if ranks not in jobs:
            outdir = tmp_path_factory.mktemp(f"optimizer-{ranks}")
            (outdir / "optimizer").mkdir()
            (outdir / "join").mkdir()
            result = run_ringrun(
                "-np",
                str(ranks),
                sys.executable,
                str(WORKERS / "in_turn.py"),
                "torch_optimizer.py",
                ",".join([*SCENARIOS, "buffers"]),
                str(outdir / "optimizer"),
                "+",
                "torch_join.py",
                JOIN_COUNTS[ranks],
                str(outdir / "join"),
                timeout=300,
            )
            jobs[ranks] = (result, outdir)
        result, outdir = jobs[ranks]
        assert result.returncode == 0, result.stdout + result.stderr
        return outdir

    return folder


@pytest.fixture(scope="module")
def run(job):
    """``run(scenario, ranks)``: each rank's report of that optimizer scenario."""

    def reports(scenario: str, ranks: int) -> list[dict]:
        outdir = job(ranks) / "optimizer"
        return [json.loads((outdir / f"{scenario}-{r}.json").read_text()) for r in range(ranks)]

    return reports


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks_train_like_one_process_on_the_union_of_their_batches(run, scenario, ranks):
    for report in run(scenario, ranks):
        assert report["matches_one_process"], report["max_difference"]
        assert report["ranks_identical"]
        # One bucket, one collective per optimizer step: accumulation sends nothing on the
        # first backward pass of each step, and unused parameters don't add collectives.
        assert report["collectives"] == STEPS
        assert not report["touched_nccl"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_given_the_model_the_optimizer_keeps_its_buffers_within_ddps_bound(job, ranks):
    outdir = job(ranks) / "optimizer"
    for rank in range(ranks):
        report = json.loads((outdir / f"buffers-{rank}.json").read_text())
        # DistributedOptimizer(module=model): within DDP's bound (the last forward's update);
        # rank 0's buffers go with each step's gradients, so no difference is left at all.
        assert report["kept"]["worst_excess_over_ddp_bound"] < 1e-5, report
        assert report["kept"]["largest_gap"] == 0.0, report
        # Without the model (Horovod's way) each rank keeps its own statistics.
        assert report["apart"]["largest_gap"] > 1.0, report
        assert report["mixed_from_rank_1"] == [
            [1.0, 1.0, 1.0],
            11,
            [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]],
            [True],
            [1.0, 1.0, 1.0, 1.0],
        ]


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
        rpt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=other.named_parameters()
        )


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


@pytest.mark.parametrize("counts", [JOIN_COUNTS[2], JOIN_COUNTS[3]])
def test_join_lets_ranks_with_more_batches_finish_with_zeros_from_the_others(job, counts):
    ranks = len(counts.split(","))
    outdir = job(ranks) / "join"
    longest = max(range(ranks), key=lambda r: int(counts.split(",")[r]))
    for rank in range(ranks):
        report = json.loads((outdir / f"{rank}.json").read_text())
        assert report["last"] == longest  # the same on every rank
        assert report["max_difference"] < 1e-5, report
        assert report["ranks_identical"]
