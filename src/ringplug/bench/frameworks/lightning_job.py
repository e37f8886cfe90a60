"""One training job of `ringplug-bench lightning` (run by it, not by hand).

(No module in this folder may be called `lightning`: the job runs as a script, with this
folder first on `sys.path`.)

``python lightning_job.py IMPL STEPS HIDDEN OUT`` trains an MLP on synthetic data with
IMPL = ring (RingStrategy, ranks from the launcher), ddp (Lightning's DDPStrategy on gloo,
2 processes it starts itself) or none (one process, no strategy), and rank 0 writes the
throughput measured after warm-up to OUT as JSON. IMPL = ring-toggle is RingStrategy with
the step-time breakdown switched on and off every `TOGGLE` steps on every rank: OUT then
also holds the median step time of each half, taken in the same job. IMPL = fabric and
fabric-nobuffers train the same MLP with a BatchNorm after each hidden layer in a Fabric loop
with `RingFabricStrategy`, rank 0's buffers sent before each forward or not
(``broadcast_buffers``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

BATCH = 32
WARMUP = 3
TOGGLE = 10  # ring-toggle: steps in each state before switching


def layers(hidden: int, norm: bool = False) -> torch.nn.Sequential:
    """The bench's MLP; with `norm`, a BatchNorm after each hidden layer (buffers to keep)."""

    def normed() -> list[torch.nn.Module]:
        return [torch.nn.BatchNorm1d(hidden)] if norm else []

    return torch.nn.Sequential(
        torch.nn.Linear(1024, hidden),
        *normed(),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        *normed(),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


class MLP(L.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = layers(hidden)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Clock(L.Callback):
    """Times the steps after warm-up."""

    def __init__(self) -> None:
        self.start = self.end = 0.0
        self.steps = 0

    def on_train_batch_end(self, trainer, *_: object) -> None:
        self.steps += 1
        if self.steps == WARMUP:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


class Toggle(L.Callback):
    """Switches the step-time breakdown on and off every TOGGLE steps (between steps, on
    every rank alike) and keeps each step's duration under the state it ran in."""

    def __init__(self) -> None:
        self.last = 0.0
        self.steps = 0
        self.times: dict[bool, list[float]] = {True: [], False: []}

    def on_train_batch_end(self, trainer, *_: object) -> None:
        import ringplug.diagnose

        now = time.perf_counter()
        self.steps += 1
        clock = trainer.strategy._diagnostics.clock
        on = ringplug.diagnose.active() is not None
        if self.steps > WARMUP:
            self.times[on].append(now - self.last)
        if self.steps % TOGGLE == 0:
            ringplug.diagnose._active = None if on else clock
        self.last = time.perf_counter()


def fabric_main(impl: str, steps: int, hidden: int, out: str) -> None:
    """A Fabric training loop on the MLP with BatchNorm, timed after warm-up."""
    from lightning.fabric import Fabric

    from ringplug.fabric import RingFabricStrategy

    strategy = RingFabricStrategy(broadcast_buffers=impl == "fabric")
    fabric = Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    model = layers(hidden, norm=True)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    rows = BATCH * fabric.world_size * steps
    data = TensorDataset(torch.randn(rows, 1024), torch.randint(0, 10, (rows,)))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH))
    start = 0.0
    for step, (x, y) in enumerate(loader, 1):
        fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step == WARMUP:
            start = time.perf_counter()
    seconds = time.perf_counter() - start
    if fabric.global_rank == 0:
        timed = steps - WARMUP
        record = {
            "impl": impl,
            "ranks": fabric.world_size,
            "steps_timed": timed,
            "seconds": seconds,
            "samples_per_s": timed * BATCH * fabric.world_size / seconds,
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        with open(out, "w") as handle:
            json.dump(record, handle)


def main(impl: str, steps: int, hidden: int, out: str) -> None:
    if impl.startswith("fabric"):
        fabric_main(impl, steps, hidden, out)
        return
    toggle = Toggle() if impl == "ring-toggle" else None
    if impl in ("ring", "ring-toggle"):
        from ringplug.lightning import RingStrategy

        strategy, devices = RingStrategy(diagnose=True if toggle else None), 1
    elif impl == "ddp":
        strategy, devices = "ddp", 2
    else:
        strategy, devices = "auto", 1
    clock = Clock()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[clock] + ([toggle] if toggle else []),
    )
    world = trainer.world_size
    rows = BATCH * world * steps
    data = TensorDataset(torch.randn(rows, 1024), torch.randint(0, 10, (rows,)))
    trainer.fit(MLP(hidden), DataLoader(data, batch_size=BATCH))
    if trainer.global_rank == 0:
        timed = clock.steps - WARMUP
        samples = timed * BATCH * world
        seconds = clock.end - clock.start
        parameters = sum(p.numel() for p in trainer.lightning_module.parameters())
        record = {
            "impl": impl,
            "ranks": world,
            "steps_timed": timed,
            "seconds": seconds,
            "samples_per_s": samples / seconds,
            "parameters": parameters,
        }
        if toggle is not None:
            for on, label in ((True, "on"), (False, "off")):
                record[f"step_ms_{label}"] = 1e3 * statistics.median(toggle.times[on])
        with open(out, "w") as handle:
            json.dump(record, handle)
    if impl == "ddp":
        # Lightning leaves its gloo group up; gloo's threads must stop before the interpreter
        # exits, or the C++ runtime aborts ("terminate called without an active exception").
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
