"""Measure, for each injected fault, the seconds from the fault to the end of the job and the
line ringrun ends with (the table in issue 17's closing note).

    python tests/measure_faults.py [--ranks 3] [--timeout 20] [--check 5] [--shutdown 10]

Runs tests/workers/faults.py under ringrun once per fault; the victim prints the time of
its fault (``FAULT <epoch>``), the end is when ringrun returns. Not a test: it only prints.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

WORKER = str(Path(__file__).parent / "workers" / "faults.py")
SCENARIOS = [
    "stop-negotiation",
    "stop-ring",
    "stop-mpi",
    "stop-user",
    "gil",
    "kill",
    "exit-3",
    "exit-0-early",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--timeout", default="20")
    parser.add_argument("--check", default="5")
    parser.add_argument("--shutdown", default="0")
    parser.add_argument("scenarios", nargs="*", default=SCENARIOS)
    args = parser.parse_args()
    env = {
        "RINGPLUG_TIMEOUT": args.timeout,
        "RINGPLUG_STALL_CHECK_SECONDS": args.check,
        "RINGPLUG_STALL_SHUTDOWN_SECONDS": args.shutdown,
        "RINGPLUG_RING_THRESHOLD": "64K",
    }
    print(f"| fault ({args.ranks} ranks, {env}) | rc | fault -> end of job | line the user sees |")
    print("|---|---|---|---|")
    for scenario in args.scenarios:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "ringplug.run.cli",
                "-np",
                str(args.ranks),
                sys.executable,
                WORKER,
                scenario,
                "measure",
            ],
            capture_output=True,
            text=True,
            timeout=float(args.timeout) + 120,
            check=False,
            env={**os.environ, **env},
        )
        end = time.time()
        output = result.stdout + result.stderr
        fault = next(
            (float(line.split()[2]) for line in output.splitlines() if " FAULT " in f" {line} "),
            None,
        )
        lines = [line for line in result.stderr.splitlines() if line.startswith("ringrun:")]
        took = f"{end - fault:.1f} s" if fault is not None else "?"
        print(
            f"| {scenario} | {result.returncode} | {took} | {' / '.join(lines)[:400]} |", flush=True
        )


if __name__ == "__main__":
    main()
