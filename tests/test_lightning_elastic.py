"""A Lightning fit under ringrun that loses a rank, or is preempted, resumes mid-epoch.

Real jobs (tests/workers/lightning_elastic.py): ``Trainer(strategy="ring")`` with
``ModelCheckpoint(save_last=True, every_n_train_steps=K)`` and ``fit(..., ckpt_path="last")``,
no resume code of the user's. Each rank's ledger of the samples it trained shows that the
resumed epoch trains each sample not yet trained once, on the ranks left.
"""

from __future__ import annotations

import signal
import sys
from collections import Counter
from pathlib import Path

import pytest

from launch import discovery_script, processes_matching, run_ringrun, unique_marker
from test_elastic import ids_of, ledger, report, restart_lines
from test_elastic import preempt as elastic_preempt

pytest.importorskip("lightning")

WORKER = str(Path(__file__).parent / "workers" / "lightning_elastic.py")


@pytest.mark.multirank
def test_a_fit_that_loses_a_rank_resumes_mid_epoch_on_the_ranks_left(tmp_path):
    # 72 samples, batches of 4, last.ckpt every 2 steps; rank 2 of 3 dies with 9 steps done
    # (epoch 1, batch 3 of 6), so the checkpoint is of step 8.
    script = discovery_script(tmp_path, "localhost:3", "localhost:2")
    marker = unique_marker("lightning-kill")
    result = run_ringrun(
        "-np",
        "3",
        "--max-restarts",
        "2",
        "--min-np",
        "2",
        "--host-discovery-script",
        str(script),
        sys.executable,
        WORKER,
        "kill",
        str(tmp_path),
        "0",
        marker,
        extra_env={"RINGPLUG_TIMEOUT": "20"},
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert processes_matching(marker) == [], "ranks were left running"
    assert result.returncode == 0, output
    (line,) = restart_lines(result.stderr)
    assert "killed by signal SIGKILL: 2 ranks on localhost:2 (was 3)" in line
    assert sorted(p.name for p in tmp_path.glob("done.*")) == ["done.1.0.json", "done.1.1.json"]

    first = [ledger(tmp_path, 0, rank) for rank in range(3)]
    again = [ledger(tmp_path, 1, rank) for rank in range(2)]
    # Rank 2 wrote step 9 before it died; the others may have been killed before they did.
    assert first[2][-1]["step"] == 9
    assert {walk[-1]["step"] for walk in first[:2]} <= {8, 9}
    saved = 8  # every rank passed its save's barrier before step 9
    # The restart goes on from the checkpoint: the step, the batch within the epoch, the weights.
    began = [report(tmp_path, 1, rank)["began"] for rank in range(2)]
    at_save = next(r for r in first[0] if r["step"] == saved)
    assert [b["step"] for b in began] == [saved, saved]
    assert began[0]["weights"] == began[1]["weights"] == at_save["weights"]
    assert [(walk[0]["step"], walk[0]["epoch"], walk[0]["batch_idx"]) for walk in again] == [
        (saved + 1, 1, 2)
    ] * 2

    # The killed epoch: what was checkpointed plus what the restart trained is every sample
    # once; only the samples of the steps after the checkpoint were trained twice.
    before = [r for walk in first for r in walk if r["epoch"] == 1 and r["step"] <= saved]
    lost = [r for walk in first for r in walk if r["epoch"] == 1 and r["step"] > saved]
    after = [r for walk in again for r in walk if r["epoch"] == 1]
    assert ids_of(before + after) == Counter(range(72))
    twice = {i for i, n in (ids_of(before + lost + after)).items() if n == 2}
    assert twice == set(ids_of(lost)) and len(twice) >= 4
    # 48 samples left for 2 ranks: 6 batches each after the 2 of before, as Lightning counts.
    assert [[r["batch_idx"] for r in walk if r["epoch"] == 1] for walk in again] == [
        list(range(2, 8))
    ] * 2
    # Epoch 0 (3 ranks) and epoch 2 (2 ranks, the whole epoch again: 9 batches each).
    assert ids_of([r for walk in first for r in walk if r["epoch"] == 0]) == Counter(range(72))
    last_epoch = [[r for r in walk if r["epoch"] == 2] for walk in again]
    assert [len(walk) for walk in last_epoch] == [9, 9]
    assert ids_of(last_epoch[0] + last_epoch[1]) == Counter(range(72))

    reports = [report(tmp_path, 1, rank) for rank in range(2)]
    assert [r["global_step"] for r in reports] == [6 + 8 + 9] * 2
    assert reports[0]["weights"] == reports[1]["weights"]
    assert [r["world"] for r in reports] == [2, 2]


@pytest.mark.multirank
def test_a_fit_that_loses_a_rank_right_after_an_epochs_last_checkpoint_trains_the_next_whole(
    tmp_path,
):
    # Rank 2 of 3 dies before step 13: last.ckpt is of step 12, the last batch of epoch 1.
    # The restart (2 ranks, 9 batches an epoch) trains all of epoch 2, not the 3 batches
    # past the 6 that epoch 1 had on 3 ranks.
    from measure_chaos import Chaos, run_chaos

    verdict, output = run_chaos(Chaos("lightning", 2, 13), tmp_path, unique_marker("epoch-end"))
    assert verdict.problems == [], output[-4000:]
    assert verdict.resumed_at == 12
    again = [ledger(tmp_path, 1, rank) for rank in range(2)]
    assert [[r["batch_idx"] for r in walk] for walk in again] == [list(range(9))] * 2


def preempt(folder: Path, ranks: int) -> tuple[int, str]:
    """The sigterm job, SIGTERMed once every rank waits after step 3: ringrun's exit code
    and output."""
    return elastic_preempt(WORKER, folder, ranks, "lightning-sigterm", wait_s=120)


@pytest.mark.multirank
def test_sigterm_saves_last_ckpt_where_every_rank_stopped_and_a_new_fit_resumes_there(tmp_path):
    torch = pytest.importorskip("torch")
    returncode, output = preempt(tmp_path, ranks=2)
    assert returncode == 128 + signal.SIGTERM, output
    first = [ledger(tmp_path, 0, rank) for rank in range(2)]
    stopped = first[0][-1]["step"]
    assert first[1][-1]["step"] == stopped  # every rank stopped after the same batch
    assert 3 < stopped < 12  # it trained on after the signal, to the agreed batch
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == stopped
    place = checkpoint["callbacks"]["RingResume"]["train_sampler"]
    assert (place["sampler"], place["epoch"], place["batches"]) == (
        "DistributedBucketSampler",
        0,
        stopped,
    )
    assert f"SIGTERM stopped training at step {stopped}; saved" in output

    marker = unique_marker("lightning-sigterm-again")
    result = run_ringrun(
        "-np", "2", sys.executable, WORKER, "sigterm", str(tmp_path), "1", marker, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    again = [ledger(tmp_path, 1, rank) for rank in range(2)]
    assert [(walk[0]["step"], walk[0]["batch_idx"]) for walk in again] == [
        (stopped + 1, stopped)
    ] * 2
    trained = [r for walk in first + again for r in walk]
    assert ids_of(trained) == Counter(range(96))  # each sample of the epoch once
    reports = [report(tmp_path, 1, rank) for rank in range(2)]
    assert [r["global_step"] for r in reports] == [12, 12]
    assert reports[0]["weights"] == reports[1]["weights"]
    assert reports[0]["began"]["weights"] == first[0][-1]["weights"]


@pytest.mark.multirank
def test_sigterm_stops_and_saves_a_single_rank_fit_too(tmp_path):
    # One rank has no batch agreement to carry its flag: it stops on its own.
    torch = pytest.importorskip("torch")
    returncode, output = preempt(tmp_path, ranks=1)
    assert returncode == 128 + signal.SIGTERM, output
    stopped = ledger(tmp_path, 0, 0)[-1]["step"]
    assert stopped == 3, output  # the batch it got the signal in (of 24 in the epoch)
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == stopped


def test_the_elastic_sampler_deals_a_whole_shuffled_epoch_as_torchs_distributed_sampler():
    # So RingStrategy can put it where Lightning put a DistributedSampler: same training.
    from torch.utils.data import DistributedSampler

    from ringplug.data import ElasticSampler

    for replicas, count, epoch in [(2, 50, 0), (3, 71, 4)]:
        for rank in range(replicas):
            ours = ElasticSampler(range(count), seed=3, num_replicas=replicas, rank=rank)
            torchs = DistributedSampler(range(count), seed=3, num_replicas=replicas, rank=rank)
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs)
