"""Other people's Lightning projects, unchanged, under RingStrategy: the acceptance runs of
issue 31, to rerun by hand (not part of the suite: they need checkouts and torchvision).

    python tests/acceptance/real_projects.py --python VENV/bin/python \\
        --template CHECKOUT_OF_lightning-hydra-template --lightning CHECKOUT_OF_pytorch-lightning

VENV needs ringplug[mpich,lightning], torchvision, hydra-core 1.3, hydra-colorlog, rootutils,
rich and jsonargparse[signatures] (torchvision from PyPI does not import beside the CPU torch
2.13 of `make venv`; torch 2.14.1 with torchvision 0.29.1 does). Nothing is downloaded: MNIST
is replaced by synthetic digits in MNIST's own file format, written where each project
looks for it.

Each run is checked as its users would check it: exit 0, the test metric printed once, one
run folder with one checkpoint folder, rank-zero log lines once. A table of the runs and
their wall times closes the output; the exit code is the number of runs that failed.
"""

from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RING_TRAINER = """\
defaults:
  - default
strategy:
  _target_: ringplug.lightning.RingStrategy
accelerator: cpu
devices: 2
"""


def write_mnist(root: Path, train: int = 60000, test: int = 10000) -> None:
    """Synthetic, learnable digits as MNIST's idx files under ROOT/MNIST/raw: TRAIN training
    and TEST test images (MNIST's own counts unless told)."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    prototypes = np.random.default_rng(0).random((10, 28, 28)) < 0.25
    for name, count, seed in (("train", train, 1), ("t10k", test, 2)):
        rng = np.random.default_rng(seed)
        labels = rng.integers(0, 10, count).astype(np.uint8)
        images = (prototypes[labels] * 160 + rng.integers(0, 96, (count, 28, 28))).astype(np.uint8)
        flipped = rng.random((count, 28, 28)) < 0.2
        images[flipped] = 255 - images[flipped]
        header = struct.pack(">IIII", 2051, count, 28, 28)
        (raw / f"{name}-images-idx3-ubyte").write_bytes(header + images.tobytes())
        (raw / f"{name}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, count) + labels.tobytes()
        )


class Run:
    def __init__(self, name: str, command: list[str], cwd: Path, logs: Path, metric: str) -> None:
        self.name, self.command, self.cwd, self.logs, self.metric = name, command, cwd, logs, metric
        self.problems: list[str] = []
        self.seconds = 0.0

    def go(self) -> None:
        env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}  # the template's fix
        started = time.monotonic()
        result = subprocess.run(
            self.command,
            cwd=self.cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        self.seconds = time.monotonic() - started
        output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
        (self.cwd / f"acceptance-{self.name}.log").write_text(output)
        if result.returncode != 0:
            self.problems.append(f"exit code {result.returncode}")
        if output.count(self.metric) != 1:
            self.problems.append(f"{self.metric!r} printed {output.count(self.metric)} times")
        folders = [p for p in self.logs.iterdir() if p.is_dir()] if self.logs.exists() else []
        if len(folders) != 1:
            self.problems.append(f"{len(folders)} run folders in {self.logs}")
        elif not any(folders[0].rglob("*.ckpt")):
            self.problems.append(f"no checkpoint under {folders[0]}")
        for line in ("Instantiating datamodule", "Starting training!", "Starting testing!"):
            if "train.py" in " ".join(self.command) and output.count(f"[rank: 0] {line}") != 1:
                self.problems.append(f"'[rank: 0] {line}' printed {output.count(line)} times")
        if "[rank: 1] Instantiating" in output:
            self.problems.append("rank 1 printed rank-zero logs")


def template_runs(python: str, ringrun: str, checkout: Path) -> list[Run]:
    write_mnist(checkout / "data")
    (checkout / "configs" / "trainer" / "ring.yaml").write_text(RING_TRAINER)
    logs = checkout / "logs" / "train" / "runs"
    base = ["src/train.py", "trainer.max_epochs=1", "logger=csv"]
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    return [
        Run(
            "template-ddp",
            [
                python,
                *base,
                "trainer=ddp",
                "trainer.accelerator=cpu",
                "trainer.devices=2",
                "trainer.sync_batchnorm=False",
            ],
            checkout,
            logs,
            "test/acc",
        ),
        Run("template-ring-python", [python, *base, "trainer=ring"], checkout, logs, "test/acc"),
        Run(
            "template-ring-ringrun",
            [
                ringrun,
                "-np",
                "2",
                python,
                *base,
                "trainer=ring",
                f"hydra.run.dir=logs/train/runs/{stamp}",
            ],
            checkout,
            logs,
            "test/acc",
        ),
    ]


def lightning_runs(python: str, ringrun: str, checkout: Path) -> list[Run]:
    basics = checkout / "examples" / "pytorch" / "basics"
    write_mnist(checkout / "examples" / "Datasets")
    write_mnist(basics / "data")  # Lightning's demo MNIST looks in ./data first
    ring = [
        "--trainer.strategy.class_path=ringplug.lightning.RingStrategy",
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=1",
    ]
    logs = basics / "lightning_logs"
    runs = []
    for script, metric in (
        ("autoencoder.py", "test_loss_epoch"),
        ("backbone_image_classifier.py", "test_loss "),
    ):
        stem = script.removesuffix(".py")
        runs += [
            Run(
                f"{stem}-ringrun-3",
                [ringrun, "-np", "3", python, script, *ring, "--trainer.limit_train_batches=200"],
                basics,
                logs,
                metric,
            ),
            Run(
                f"{stem}-python-2",
                [python, script, *ring, "--trainer.devices=2", "--trainer.limit_train_batches=200"],
                basics,
                logs,
                metric,
            ),
        ]
    return runs


def clean(run: Run) -> None:
    if run.logs.exists():
        subprocess.run(["rm", "-rf", str(run.logs)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="the venv's interpreter")
    parser.add_argument("--template", type=Path, help="a checkout of lightning-hydra-template")
    parser.add_argument("--lightning", type=Path, help="a checkout of pytorch-lightning")
    args = parser.parse_args()
    ringrun = str(Path(args.python).with_name("ringrun"))
    runs = []
    if args.template:
        runs += template_runs(args.python, ringrun, args.template.resolve())
    if args.lightning:
        runs += lightning_runs(args.python, ringrun, args.lightning.resolve())
    for run in runs:
        clean(run)
        run.go()
        print(f"{run.name:34} {run.seconds:6.1f} s  {'; '.join(run.problems) or 'ok'}", flush=True)
    return sum(bool(run.problems) for run in runs)


if __name__ == "__main__":
    sys.exit(main())
