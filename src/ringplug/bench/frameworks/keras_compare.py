"""`ringplug-bench keras`: ringplug against tf.distribute.MultiWorkerMirroredStrategy on CPU.

It starts every job itself, in alternating pairs: 2 ranks with ringplug's
DistributedOptimizer and RingBroadcast (under ringrun) against 2 MWMS workers on localhost
with ring collectives, and 1 rank with ringplug against plain Keras (the overhead of the
wrapper and callbacks when nothing is communicated). TensorFlow backend, the same MLP,
per-rank batch 32, one intra-op and two inter-op threads per rank for every job.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..common import alternating_pairs, write_job_json

JOB = str(Path(__file__).with_name("keras_job.py"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=5, help="alternating pairs per comparison")
    parser.add_argument("--steps", type=int, default=60, help="training steps per job")
    parser.add_argument(
        "--hidden", type=int, default=2048, help="MLP width (2048: about 6.3 M parameters)"
    )
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _job(impl: str, ranks: int, args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / f"{impl}-{ranks}.json"
    command = [sys.executable, JOB, impl, str(args.steps), str(args.hidden), str(out)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "KERAS_BACKEND": "tensorflow",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    if impl == "mwms":
        workers = [f"localhost:{port}" for port in _free_ports(ranks)]
        processes = []
        for index in range(ranks):
            config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            processes.append(
                subprocess.Popen(
                    command,
                    env={**env, "TF_CONFIG": json.dumps(config)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        failed = []
        for process in processes:
            _, stderr = process.communicate(timeout=900)
            if process.returncode != 0:
                failed.append(stderr)
        if failed:
            raise SystemExit(f"ringplug-bench keras: an mwms worker failed:\n{failed[0][-3000:]}")
        return json.loads(out.read_text())
    if impl == "ringplug":
        command = [sys.executable, "-m", "ringplug.run.cli", "-np", str(ranks), *command]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"ringplug-bench keras: the {impl} job failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="ringplug-bench-keras-") as tmp:
        records, ratios = alternating_pairs(
            args.pairs,
            [
                ("ringplug/mwms", "ringplug", "mwms", 2),
                ("ringplug-1/plain", "ringplug", "plain", 1),
            ],
            lambda impl, ranks: _job(impl, ranks, args, Path(tmp)),
            lambda impl, ranks: f"{impl}-1" if ranks == 1 and impl == "ringplug" else impl,
        )
    over_mwms = statistics.median(ratios["ringplug/mwms"])
    overhead = 1 - statistics.median(ratios["ringplug-1/plain"])
    print(f"# median ringplug / MWMS throughput, 2 ranks: {over_mwms:.3f}x (target >= 1.2)")
    print(f"# median ringplug overhead with 1 rank against plain Keras: {overhead * 100:.1f}%")
    if args.json:
        write_job_json(
            args.json,
            "keras",
            {
                "pairs": args.pairs,
                "steps": args.steps,
                "hidden": args.hidden,
                "median_ringplug_over_mwms": over_mwms,
                "median_overhead_1_rank": overhead,
            },
            records,
        )
    return 0
