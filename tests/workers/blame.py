"""Multi-rank worker: failures whose ranks end in an order that hides the root cause.

``python blame.py SCENARIO MARKER``; MARKER rides along in argv so the test can look for
leftover processes. Each scenario is one the issue saw blame the wrong rank:

  exit-while-computing  rank 0 calls sys.exit(3) while the others compute (they call no
                        collective for COMPUTE_S seconds); the job must end with code 3
                        and name rank 0, without waiting for the others' computation
  caught                rank 1's own code raises; the program catches the exception
                        around its training loop, prints it and calls sys.exit(1) on every
                        rank (rank 0's error is the PeerLeftError that rank 1's exit
                        caused); rank 1 must be named, with code 1
  caught-late           the same, but rank 1 leaves only after rank 0 has ended (the
                        order that blamed rank 0: rank 1 is then stopped in the teardown)
  caught-lightning      the same around `trainer.fit` of a RingStrategy fit: rank 1's
                        training_step raises at batch 3
  kill-then-raise       3 ranks: rank 1 is SIGKILLed; rank 2 sees it gone and raises an
                        exception of its own (uncaught, blaming nobody, as a library's
                        "connection reset" would) before rank 1's wrapper reports; rank 1
                        must be named, killed by SIGKILL
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import ringplug

COMPUTE_S = 30.0


def warm_up(buf: np.ndarray) -> None:
    for _ in range(3):
        ringplug.allreduce(buf, op=ringplug.Sum, out=buf, name="warm-up")


def forever(buf: np.ndarray) -> None:
    while True:
        ringplug.allreduce(buf, op=ringplug.Sum, out=buf, name="step")


def compute(seconds: float) -> None:
    """Busy CPU work between collectives, as a long forward/backward is."""
    end = time.monotonic() + seconds
    a = np.random.default_rng(0).standard_normal((64, 64))
    while time.monotonic() < end:
        a = np.tanh(a @ a.T)


def caught(rank: int, small: np.ndarray, late: bool) -> None:
    pids = ringplug.allgather(np.array([os.getpid()], np.int64), name="pids")
    try:
        for step in range(1000):
            if rank == 1 and step == 3:
                raise ValueError("bad batch 3 on rank 1 (planted)")
            ringplug.allreduce(small, op=ringplug.Sum, out=small, name="step")
    except Exception as error:  # noqa: BLE001 - what the user's program does
        print(f"rank {rank} caught {type(error).__name__}: {error}", flush=True)
        if late and rank == 1:
            ringplug.shutdown()  # rank 0 hears of it at once ...
            wait_until_gone(int(pids[0]))  # ... and ends first
        sys.exit(1)


def wait_until_gone(pid: int) -> None:
    """Until the process `pid` (a rank on this host) has ended."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def caught_lightning(rank: int) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ringplug.lightning import RingStrategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if self.global_rank == 1 and batch_idx == 3:
                raise ValueError("bad batch 3 on rank 1 (planted)")
            (x,) = batch
            return self.layer(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = DataLoader(TensorDataset(torch.randn(256, 4)), batch_size=4)
    trainer = L.Trainer(
        strategy=RingStrategy(),
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(Net(), data)
    except Exception as error:  # noqa: BLE001 - the pattern the issue saw
        print(f"rank {rank} caught {type(error).__name__}: {error}", flush=True)
        sys.exit(1)


def kill_then_raise(rank: int, small: np.ndarray) -> None:
    pids = ringplug.allgather(np.array([os.getpid()], np.int64), name="pids")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2:
        wait_until_gone(int(pids[1]))
        raise ConnectionResetError("lost the connection to a peer (planted)")
    forever(small)


def main(scenario: str) -> None:
    ringplug.init()
    rank = ringplug.rank()
    small = np.ones(1000, np.float32)
    if scenario == "caught-lightning":
        caught_lightning(rank)
        return
    warm_up(small)
    if scenario == "exit-while-computing":
        if rank == 0:
            sys.exit(3)
        compute(COMPUTE_S)
        print(f"rank {rank} computed for {COMPUTE_S:g} s", flush=True)
        forever(small)
    if scenario in ("caught", "caught-late"):
        caught(rank, small, late=scenario == "caught-late")
    if scenario == "kill-then-raise":
        kill_then_raise(rank, small)
    raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(sys.argv[1])
