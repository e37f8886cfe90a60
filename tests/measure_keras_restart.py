"""Measure how long a Keras fit under ringrun takes from a lost rank to its first step
after the restart, and what the time is made of.

    python tests/measure_keras_restart.py [--runs 5] [--backend tensorflow]

Runs tests/workers/keras_elastic.py's ``kill`` job (3 ranks, rank 2 SIGKILLed at step 10,
restarted on 2, Keras's ``BackupAndRestore`` beside ``RingBroadcast``) once per run. Times
(``time.time()``): the kill (the victim writes it), ringrun's second call of the discovery
script (the failed job is torn down by then), and, on rank 0 of the restart, the script's
start, the end of its imports (Keras, its backend, ringplug), the end of the backup's restore
(``on_train_begin``: model, dataset, read and broadcast) and the end of its first step. Not
a test: it only prints.
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
WORKER = str(HERE / "workers" / "keras_elastic.py")
RINGRUN = [sys.executable, "-m", "ringplug.run.cli"]
PHASES = [
    ("detection + teardown", "kill", "discovered"),
    ("restart (mpiexec, python)", "discovered", "script"),
    ("imports (keras, backend, ringplug)", "script", "imported"),
    ("init, model, dataset, restore", "imported", "restored"),
    ("to the end of the first step", "restored", "first_step"),
    ("kill -> first step", "kill", "first_step"),
]


def one_run(backend: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ringplug-keras-restart-") as name:
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
            "measure-keras",
        ]
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            stdin=subprocess.DEVNULL,
            env=env,
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
    parser.add_argument("--backend", default="tensorflow", choices=["tensorflow", "torch", "jax"])
    args = parser.parse_args()
    runs = [one_run(args.backend) for _ in range(args.runs)]
    print(f"| phase ({args.backend}) | median s ({args.runs} runs) | runs |")
    print("|---|---|---|")
    for label, begin, end in PHASES:
        spans = [run[end] - run[begin] for run in runs]
        each = ", ".join(f"{s:.2f}" for s in spans)
        print(f"| {label} | {statistics.median(spans):.2f} | {each} |")


if __name__ == "__main__":
    main()
