"""Measure how long a Lightning fit under ringrun takes from a lost rank to its first step
after the restart, and what the time is made of.

    python tests/measure_lightning_restart.py [--runs 5]

Runs tests/workers/lightning_elastic.py's ``kill`` job (3 ranks, rank 2 SIGKILLed at step 10,
restarted on 2 with ``ckpt_path="last"``) once per run. Times (``time.time()``): the kill (the
victim writes it), ringrun's second call of the discovery script (the failed job is torn
down by then), and, on rank 0 of the restart, the script's start, the end of its imports,
the checkpoint load and the end of its first step. Not a test: it only prints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launch import discovery_script

HERE = Path(__file__).parent
WORKER = str(HERE / "workers" / "lightning_elastic.py")
RINGRUN = [sys.executable, "-m", "ringplug.run.cli"]
PHASES = [
    ("detection + teardown", "kill", "discovered"),
    ("restart (mpiexec, python)", "discovered", "script"),
    ("imports (torch, lightning, ringplug)", "script", "imported"),
    ("init, Trainer, checkpoint load", "imported", "checkpoint_loaded"),
    ("to the end of the first step", "checkpoint_loaded", "first_step"),
    ("kill -> first step", "kill", "first_step"),
]


def one_run() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ringplug-restart-") as name:
        folder = Path(name)
        three_then_two = discovery_script(folder, "localhost:3", "localhost:2")
        command = [
            *RINGRUN,
            "-np",
            "3",
            "--max-restarts",
            "2",
            "--min-np",
            "2",
            "--host-discovery-script",
            str(three_then_two),
            sys.executable,
            WORKER,
            "kill",
            str(folder),
            "0",
            "measure-restart",
        ]
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            stdin=subprocess.DEVNULL,
            env=os.environ.copy(),
        )
        if done.returncode != 0:
            raise SystemExit(f"the job failed ({done.returncode}):\n{done.stderr[-3000:]}")
        times = json.loads((folder / "times.1.json").read_text())
        times["kill"] = json.loads((folder / "kill.json").read_text())["time"]
        times["discovered"] = float((folder / "discovered").read_text().split()[1])
        return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runs = [one_run() for _ in range(args.runs)]
    print(f"| phase | median s ({args.runs} runs) | runs |")
    print("|---|---|---|")
    for label, begin, end in PHASES:
        spans = [run[end] - run[begin] for run in runs]
        each = ", ".join(f"{s:.2f}" for s in spans)
        print(f"| {label} | {statistics.median(spans):.2f} | {each} |")


if __name__ == "__main__":
    main()
