"""Multi-rank worker: a Lightning fit under ringrun that stops midway and resumes mid-epoch.

``python lightning_elastic.py SCENARIO DIR RUNS MARKER``: RUNS is how many times the test
started the job before (the start is RUNS + RINGPLUG_RESTART); MARKER names the processes.

  kill     72 samples, a plain shuffled DataLoader (RingStrategy puts in its ElasticSampler),
           3 epochs, ``last.ckpt`` every 2 steps. In the first start (RINGPLUG_RESTART=0)
           rank 2 SIGKILLs itself before step 10 (after writing DIR/kill.json with the
           time, rank and step); the restarted job resumes with ``ckpt_path="last"``.
           ELASTIC_KILL_RANK and ELASTIC_KILL_STEP choose another rank and step (the
           rank dies with ELASTIC_KILL_STEP - 1 steps done).
  hold     the kill job, but no rank kills itself: in the first start every rank writes
           DIR/running.<rank> ("pid hostname") after step ELASTIC_HOLD_STEP (default 5)
           and waits (bounded) for DIR/go to exist, so that a test can take a host away.
           With ELASTIC_HOLD_HOSTNAME, only the ranks on that host wait; the others train
           on, and wait for them in the next step's allreduce.
  sigterm  96 samples in a DistributedBucketSampler, 1 epoch. In the first start every rank
           writes DIR/running.<rank> after step 3 and waits (bounded) for SIGTERM, which
           RingStrategy turns into a ``last.ckpt`` at the step where every rank stops; a
           second start resumes from it.

Every rank appends each trained batch to DIR/ledger.<start>.<rank>.jsonl (its sample ids,
the global step, loss and weights after it, the epoch and batch_idx), and writes
DIR/done.<start>.<rank>.json at the end of a fit (global step, weights, the world, the step
and weights it started from).
Rank 0 of a restart writes DIR/times.<start>.json: when the script started, when Lightning
was imported, when the checkpoint was loaded and when the first step ended (time.time()).
"""

from __future__ import annotations

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import ringplug  # noqa: E402
import ringplug.lightning  # noqa: E402, F401  (registers strategy="ring")
from ringplug.data import DistributedBucketSampler  # noqa: E402

IMPORTED = time.time()
BATCH = 4
# By default rank 2 of the first start dies with 9 steps done; last.ckpt is of 8.
KILL_RANK = int(os.environ.get("ELASTIC_KILL_RANK", "2"))
KILL_BEFORE_STEP = int(os.environ.get("ELASTIC_KILL_STEP", "10"))
HOLD_STEP = int(os.environ.get("ELASTIC_HOLD_STEP", "5"))
HOLD_HOSTNAME = os.environ.get("ELASTIC_HOLD_HOSTNAME")  # unset: every rank holds
HOLD_TIMEOUT_S = 120.0


class Numbered(Dataset):
    """Sample i is (x_i, y_i, i): the ledger names samples by id."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(5)
        self.x = torch.randn(count, 4, generator=generator)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


class Regressor(L.LightningModule):
    def __init__(self, folder: Path, start: int, kill: bool, hold: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.folder, self.start, self.kill, self.hold = folder, start, kill, hold
        self.last_loss = float("nan")
        self.rank = ringplug.rank()
        self.ledger = open(folder / f"ledger.{start}.{self.rank}.jsonl", "a")  # noqa: SIM115
        self.times: dict[str, float] = {"script": STARTED, "imported": IMPORTED}
        self.began: dict | None = None

    def weights(self) -> list[float]:
        return torch.cat([p.detach().reshape(-1) for p in self.parameters()]).tolist()

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)

    def on_load_checkpoint(self, checkpoint) -> None:
        self.times["checkpoint_loaded"] = time.time()

    def on_train_start(self) -> None:
        self.began = {"step": self.trainer.global_step, "weights": self.weights()}

    def on_train_batch_start(self, batch, batch_idx) -> None:
        trainer = self.trainer
        if (
            self.kill
            and self.start == 0
            and self.rank == KILL_RANK
            and (trainer.global_step == KILL_BEFORE_STEP - 1)
        ):
            killed = {"time": time.time(), "rank": self.rank, "step": trainer.global_step}
            (self.folder / "kill.json").write_text(json.dumps(killed))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        trainer = self.trainer
        record = {
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "batch_idx": batch_idx,
            "ids": batch[2].tolist(),
            "loss": self.last_loss,
            "weights": self.weights(),
        }
        self.ledger.write(json.dumps(record) + "\n")
        self.ledger.flush()
        if self.hold and self.start == 0 and trainer.global_step == HOLD_STEP:
            hold(self.folder, self.rank)
        if "first_step" not in self.times:
            self.times["first_step"] = time.time()
            if self.start > 0 and self.rank == 0:
                (self.folder / f"times.{self.start}.json").write_text(json.dumps(self.times))


def hold(folder: Path, rank: int) -> None:
    """Say where this rank runs (DIR/running.<rank>), then wait for DIR/go (bounded)."""
    partial = folder / f".running.{rank}"
    partial.write_text(f"{os.getpid()} {socket.gethostname()}")
    partial.rename(folder / f"running.{rank}")
    if HOLD_HOSTNAME is not None and socket.gethostname() != HOLD_HOSTNAME:
        return
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not (folder / "go").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {folder / 'go'} within {HOLD_TIMEOUT_S:g} s")
        time.sleep(0.05)


class WaitForSigterm(L.Callback):
    """After step 3 of the first start: say so, then wait (bounded) for ringrun's SIGTERM."""

    def __init__(self, folder: Path, received: threading.Event) -> None:
        self.folder, self.received = folder, received

    def on_train_batch_end(self, trainer, *_: object) -> None:
        if trainer.global_step == 3:
            (self.folder / f"running.{ringplug.rank()}").write_text("")
            if not self.received.wait(60):
                raise RuntimeError("no SIGTERM came within 60 s")


def main(scenario: str, folder: Path, runs: int) -> None:
    ringplug.init()
    start = runs + int(os.environ.get("RINGPLUG_RESTART", "0"))
    rank, size = ringplug.rank(), ringplug.size()
    callbacks: list[L.Callback] = []
    if scenario in ("kill", "hold"):
        dataset = Numbered(72)
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
        epochs, every = 3, 2
    else:
        dataset = Numbered(96)
        lengths = [1 + (i * 7) % 13 for i in range(len(dataset))]
        loader = DataLoader(dataset, batch_sampler=DistributedBucketSampler(lengths, BATCH))
        epochs, every = 1, 1000
        if start == 0:
            received = threading.Event()
            # Lightning's SIGTERM handler calls the one it finds installed, too.
            signal.signal(signal.SIGTERM, lambda *_: received.set())
            callbacks.append(WaitForSigterm(folder, received))
    checkpoint = ModelCheckpoint(
        dirpath=folder / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=every
    )
    model = Regressor(folder, start, kill=scenario == "kill", hold=scenario == "hold")
    trainer = L.Trainer(
        strategy="ring",
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, checkpoint],
    )
    trainer.fit(model, loader, ckpt_path="last")
    report = {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "weights": model.weights(),
        "world": size,
        "began": model.began,
    }
    (folder / f"done.{model.start}.{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
