"""The GPU checks, most informative first, each under its own timeout; a JSON report.

``python tests/gpu/run_checks.py [--device cpu] [--out FOLDER] [--plan]`` (check_gpu.sh runs
it). The timeouts add up to at most 400 s (check_gpu.sh, with its wheels, at most 8
minutes), so the whole run fits a ten-minute slot on a shared GPU machine with time to
start. The report (``FOLDER/gpu-report.json``, FOLDER from ``--out`` or ``$OUT``) lists
every step: its command, status (pass, fail, timeout, skip), seconds, and the lines it
printed that start with PASS, FAIL or SKIP.

``--device cpu`` is the dry run: the steps that can run on CPU tensors do (the two-rank
script on the MPI path); the ones that need a GPU are skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGET_S = 400  # check_gpu.sh: 45 s for wheels, this, the rest for starting


def steps(python: str, device: str) -> list[dict]:
    """Every step: name, timeout, command, environment, whether it runs on CPU, and the exit
    code it must end with."""
    ringrun = [python, "-m", "ringplug.run.cli"]
    two = [*ringrun, "-np", "2", "-x", "NCCL_SOCKET_IFNAME=lo", python, str(HERE / "two_ranks.py")]
    cpu = ["--device", "cpu"] if device == "cpu" else []
    return [
        {
            "name": "nccl-mapped",
            "timeout": 30,
            "cpu": False,
            "command": [python, str(HERE / "check_gpu.py"), "nccl-mapped"],
        },
        {
            "name": "one-rank",
            "timeout": 130,
            "cpu": False,
            "command": [python, str(HERE / "check_gpu.py")],
        },
        {
            "name": "timeout",
            "timeout": 30,
            "cpu": False,
            "command": [python, str(HERE / "check_gpu.py"), "timeout"],
        },
        {
            "name": "cudart-path",
            "timeout": 30,
            "cpu": False,
            "command": [python, str(HERE / "check_cudart.py")],
        },
        {
            "name": "two-ranks",
            "timeout": 60,
            "cpu": True,
            "command": [*two, *cpu],
            "env": {"RINGPLUG_TIMEOUT": "20"},
        },
        {
            "name": "two-ranks-exit-early",
            "timeout": 30,
            "cpu": True,
            "expect": 3,
            "command": [*two, *cpu, "--exit-early"],
            "env": {"RINGPLUG_TIMEOUT": "10"},
        },
        {
            "name": "lightning-fit",
            "timeout": 50,
            "cpu": False,
            "command": [python, str(HERE / "check_fits.py"), "lightning"],
        },
        {
            "name": "bench",
            "timeout": 40,
            "cpu": False,
            "command": [
                python,
                "-m",
                "ringplug.bench.cli",
                "allreduce",
                "--device",
                "cuda",
                "--min-size",
                "4K",
                "--max-size",
                "64M",
                "--budget",
                "0.05",
            ],
        },
    ]


def run_step(step: dict, device: str) -> dict:
    record = {"name": step["name"], "timeout_s": step["timeout"], "command": step["command"]}
    if device == "cpu" and not step["cpu"]:
        return {**record, "status": "skip", "reason": "needs a GPU (dry run on CPU)"}
    env = {**os.environ, **step.get("env", {})}
    start = time.monotonic()
    try:
        result = subprocess.run(
            step["command"],
            capture_output=True,
            text=True,
            timeout=step["timeout"],
            env=env,
            check=False,
        )
        output, code = result.stdout + result.stderr, result.returncode
        status = "pass" if code == step.get("expect", 0) else "fail"
        if code == 2 and "sees no GPU" in output:
            status = "skip"
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or ""
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        code, status = None, "timeout"
    checks = [
        line.split("] ", 1)[-1]
        for line in output.splitlines()
        if line.split("] ", 1)[-1].startswith(("PASS", "FAIL", "SKIP"))
    ]
    if status == "pass" and any(line.startswith("FAIL") for line in checks):
        status = "fail"
    return {
        **record,
        "status": status,
        "exit_code": code,
        "seconds": round(time.monotonic() - start, 1),
        "checks": checks,
        "tail": output.splitlines()[-15:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".")
    parser.add_argument("--plan", action="store_true", help="print the steps and their timeouts")
    args = parser.parse_args()
    plan = steps(sys.executable, args.device)
    total = sum(step["timeout"] for step in plan)
    assert total <= BUDGET_S, f"the steps' timeouts add up to {total} s, over {BUDGET_S}"
    if args.plan:
        for step in plan:
            print(f"{step['timeout']:4d} s  {step['name']}")
        print(f"{total:4d} s  in all (at most {BUDGET_S})")
        return 0
    report = {"device": args.device, "budget_s": BUDGET_S, "timeouts_s": total, "steps": []}
    for step in plan:
        record = run_step(step, args.device)
        report["steps"].append(record)
        print(
            f"== {record['name']}: {record['status']}"
            + (f" ({record['seconds']} s)" if "seconds" in record else ""),
            flush=True,
        )
        for line in record.get("checks", []):
            print(f"   {line}", flush=True)
        if record["status"] in ("fail", "timeout"):
            for line in record.get("tail", []):
                print(f"   | {line}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu-report.json"
    path.write_text(json.dumps(report, indent=2))
    failed = [s["name"] for s in report["steps"] if s["status"] in ("fail", "timeout")]
    print(
        f"run_checks.py: report in {path}; "
        + (f"FAILED: {', '.join(failed)}" if failed else "nothing failed")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
