"""``hvd.elastic`` on ringrun's restarts: what commit, restore and sync keep and give back
(in one process), and a Horovod-style elastic torch training on 3 ranks that loses one,
is restarted by ringrun on 2 and resumes from its last commit."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

from launch import discovery_script, processes_matching, run_ringrun, unique_marker

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("ringplug.horovod.torch")
from ringplug import elastic as _elastic  # noqa: E402

WORKER = str(Path(__file__).parent / "workers" / "hvd_elastic.py")


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch, tmp_path):
    hvd.init()
    for name in ("RINGPLUG_RESTART", "RINGPLUG_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RINGPLUG_ELASTIC_DIR", str(tmp_path / "commits"))
    monkeypatch.setattr(_elastic, "_resumed", False)


def torch_state(**kwargs):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return hvd.elastic.TorchState(model, optimizer, **kwargs)


def step(state) -> None:
    state.optimizer.zero_grad()
    state.model(torch.ones(4, 3)).sum().backward()
    state.optimizer.step()


def test_object_state_restore_undoes_what_changed_since_the_commit():
    state = hvd.elastic.ObjectState(epoch=0, seen=[1])
    state.epoch, state.seen = 3, [1, 2]
    state.commit()
    state.epoch = 4
    state.seen.append(3)  # a change in place is undone too: the commit is a copy
    state.restore()
    assert (state.epoch, state.seen) == (3, [1, 2])


def test_object_state_restore_before_any_commit_gives_the_initial_values():
    state = hvd.elastic.ObjectState(batch=7)
    state.batch = 9
    state.restore()
    assert state.batch == 7


def test_torch_state_restore_gives_back_weights_and_optimizer_momentum():
    state = torch_state(epoch=1)
    step(state)
    state.commit()
    weights = state.model.weight.detach().clone()
    momentum = state.optimizer.state[state.model.weight]["momentum_buffer"].clone()
    step(state)
    state.epoch = 2
    assert not torch.equal(state.model.weight, weights)
    state.restore()
    assert torch.equal(state.model.weight, weights)
    assert torch.equal(state.optimizer.state[state.model.weight]["momentum_buffer"], momentum)
    assert state.epoch == 1


def test_torch_state_keeps_a_sampler_by_its_state_dict():
    dataset = list(range(40))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=False)
    state = hvd.elastic.TorchState(train_sampler=sampler)
    sampler.record_batch(1, 5)  # 10 samples trained
    state.commit()
    sampler.record_batch(5, 5)
    state.restore()
    assert state.train_sampler is sampler  # loaded back into the same object
    assert list(sampler) == list(range(10, 40))


def test_sync_gives_rank_0s_state_and_saves_it():
    state = hvd.elastic.ObjectState(epoch=5)
    state.sync()
    state.epoch = 6
    state.restore()
    assert state.epoch == 5


def test_a_commit_is_written_to_disk_once_and_replaces_the_one_before(tmp_path):
    state = hvd.elastic.ObjectState(epoch=0)
    for epoch in (1, 2):
        state.epoch = epoch
        state.commit()
    files = sorted(p.name for p in (tmp_path / "commits").iterdir())
    assert files == ["commit-2.pkl"]
    size, saved = _elastic.CommitStore(tmp_path / "commits").read(2)
    assert size == 1 and pickle.loads(saved) == {"epoch": 2}


def test_run_on_a_restart_resumes_from_the_commit_on_disk(monkeypatch):
    first = torch_state(epoch=0)
    step(first)
    first.epoch = 3
    first.commit()
    # A new process of the restarted job: new objects, the commit on disk.
    monkeypatch.setenv("RINGPLUG_RESTART", "1")
    second = torch_state(epoch=0)
    resets = []
    second.register_reset_callbacks([lambda: resets.append(hvd.size())])
    seen = hvd.elastic.run(lambda state: (state.epoch, state.model.weight.detach().clone()))
    epoch, weights = seen(second)
    assert epoch == 3 and torch.equal(weights, first.model.weight)
    assert resets == []  # committed by as many ranks as now: no reset


def test_run_on_a_first_start_ignores_commits_left_on_disk(monkeypatch):
    left = hvd.elastic.ObjectState(epoch=9)
    left.commit()
    state = hvd.elastic.ObjectState(epoch=0)
    assert hvd.elastic.run(lambda s: s.epoch)(state) == 0


def test_a_failed_collective_in_the_training_function_is_not_swallowed(capsys):
    from ringplug.core.errors import PeerLeftError

    def train(state):
        raise PeerLeftError("rank 2 left")

    with pytest.raises(PeerLeftError):
        hvd.elastic.run(train)(hvd.elastic.ObjectState(epoch=0))
    assert "ringrun restarts the job from the last commit" in capsys.readouterr().err


def test_check_host_updates_never_interrupts():
    state = hvd.elastic.ObjectState(epoch=0)
    assert state.check_host_updates() is None


# ------------------------------------------------------------------------- real ranks
def ledger(folder: Path, restart: int, rank: int) -> list[dict]:
    path = folder / f"ledger.{restart}.{rank}"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multirank
def test_a_killed_rank_costs_only_the_batches_since_the_last_commit(tmp_path):
    marker = unique_marker("hvd-elastic")
    result = run_ringrun(
        "-np",
        "3",
        "--min-np",
        "2",
        "--max-restarts",
        "2",
        "--host-discovery-script",
        str(discovery_script(tmp_path, "localhost:3", "localhost:2")),
        sys.executable,
        WORKER,
        str(tmp_path),
        marker,
        extra_env={"RINGPLUG_TIMEOUT": "30", "TMPDIR": str(tmp_path)},
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert processes_matching(marker) == []
    assert "restart 1 of 2 after rank 2" in result.stderr
    assert "resumed from commit 5 (made by 3 ranks; 2 now)" in output
    # The second start: 2 ranks, began where commit 5 was (epoch 0, batch 14), same job.
    starts = [
        json.loads((tmp_path / f"start.{s}.{r}").read_text()) for s, r in [(0, 0), (1, 0), (1, 1)]
    ]
    assert starts[1] == starts[2]
    assert starts[1]["job"] == starts[0]["job"] is not None
    assert (starts[1]["epoch"], starts[1]["batch"], starts[1]["commits"]) == (0, 14, 5)
    assert (starts[1]["size"], starts[1]["lr"]) == (2, pytest.approx(0.02))  # reset callback
    resets = sorted(p.name for p in tmp_path.glob("reset.*"))
    assert resets == ["reset.1.0", "reset.1.1"]
    assert all((tmp_path / name).read_text() == "2\n" for name in resets)
    # Every sample of every epoch trained: by the first start up to commit 5, then the rest.
    for epoch in (0, 1):
        trained = [
            i
            for r in range(3)
            for line in ledger(tmp_path, 0, r)
            if line["commit"] <= 5 and line["epoch"] == epoch
            for i in line["ids"]
        ]
        trained += [
            i
            for r in range(2)
            for line in ledger(tmp_path, 1, r)
            if line["epoch"] == epoch
            for i in line["ids"]
        ]
        assert set(trained) == set(range(240)), f"epoch {epoch} skipped samples"
        # The 1 uncommitted batch is trained again; repeats beyond it only pad the last round.
        assert len(trained) - 240 < 2 * 4, f"epoch {epoch} trained samples twice"
    finals = {(tmp_path / f"final.1.{r}").read_text() for r in range(2)}
    assert len(finals) == 1  # identical weights on both ranks
    assert list(tmp_path.glob("final.0.*")) == []
    assert list(tmp_path.glob("ringplug-elastic-*")) == []  # ringrun removed the commits
