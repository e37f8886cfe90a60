"""`ringplug-bench scale`: what a rank pays per step as the job grows, measured and modelled.

It starts every job itself (run it as a plain command, not under ringrun) and has four parts
(``--parts``):

- ``counts``: jobs of p ranks on this machine (oversubscribed; p up to ``--max-ranks``) run
  a training-like step (8 named 4 KiB allreduces, then a 1 MiB and a 16 MiB allreduce) and
  report, per rank per step, the messages and bytes the engine sent (`Engine.traffic`) and,
  where a C compiler and MPI's headers are at hand, what an MPI profiling library preloaded
  into the ranks counted (tests/pmpi/count_sends.c, built here); next to them, the figures
  of the all-to-all negotiation this replaced (its p - 1 sends, quoted from issue 44).
- ``cpu``: the small step again with 1, 8 and 32 tensors: in the counts jobs, its CPU time
  outside the engine's waits; in jobs of their own (`scale_job.CallCounter`), the function
  calls it makes outside the waits, counted by part (the agreement, recursive doubling,
  the rest). Calls do not change when ranks share the cores; what one call costs is
  measured in the jobs whose ranks each have a core.
- ``sets``: a process set of k ranks inside a world of p (``--sets``, default 4 in 16 and 8
  in 32), spread over the world, runs the 8 x 4 KiB step and the 1 MiB allreduce on its own
  engine: per member per step, the set engine's messages and bytes and the profiling
  library's count of every send of the process, side by side with a set of all k ranks of
  a world of k (what the set must cost: growing with k, not p).
- ``bed``: a multi-host bed (`ringplug.bench.netbed`: network namespaces with sshd, links
  shaped with ``tc``) of ``--hosts`` hosts, one rank each, then two; ringplug, MPI's own
  Allreduce and torch gloo side by side on 4 KiB, 1 MiB, 64 MiB and ResNet-50's gradients.
  It needs root; without it the part is skipped, saying why.
- ``model``: an alpha-beta-gamma model of wall time and a model of the calls of an agreed
  cycle (`ringplug.bench.scale_model`) fitted to the points of the other parts, their
  error on each, and what they predict at 64, 512 and 4096 ranks: the engine's CPU per
  agreed cycle, and the step overhead and scaling efficiency of Horovod's 512-GPU
  benchmark setting and of a CPU job.

Example:
    ringplug-bench scale --max-ranks 16 --parts counts,cpu,model --json scale.json
    ringplug-bench scale --parts sets --sets 16:4,32:8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..core.engine.exchange import GATHER_ONLY_UP_TO
from ..core.transport.traffic import DATA, NEGOTIATION
from . import scale_model
from .netbed import BedUnavailable, NetBed, Shape, uniform_hosts
from .scale_job import SMALL_PHASES
from .scale_model import CpuModel, Fit, Point, StepPoint

PARTS = ("counts", "cpu", "sets", "bed", "model")
# Issue 44's measurement of the all-to-all negotiation (rank 0, an MPI profiling library):
# p -> (sends per 8 x 4 KiB step, bytes sent per step, sends per 1 MiB allreduce).
ALL_TO_ALL = {2: (1, 33e3, 3), 4: (3, 98e3, 9), 8: (7, 230e3, 21), 16: (16, 527e3, 60)}
PROFILER = Path(__file__).resolve().parents[3] / "tests" / "pmpi" / "count_sends.c"
STEP_TENSORS = {"1x4K": 1, "8x4K": 8, "32x4K": 32, "1M": 1, "16M": 1}
STEP_BYTES = {"1x4K": 4096, "8x4K": 8 * 4096, "32x4K": 32 * 4096, "1M": 1 << 20, "16M": 16 << 20}
JOB_TIMEOUT_S = 420


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    parser.add_argument(
        "--ranks", default="2,4,8,16,32", help="world sizes of the counts jobs (default 2..32)"
    )
    parser.add_argument("--max-ranks", type=int, default=32, help="leave out larger sizes")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per phase")
    parser.add_argument(
        "--cpu-steps",
        type=int,
        default=100,
        help="measured steps of each small step (1, 8 and 32 x 4 KiB) of the counts jobs, "
        "whose CPU the cpu part reports (default 100: a few steps are mostly warm-up)",
    )
    parser.add_argument(
        "--sets",
        default="16:4,32:8",
        help="P:K pairs of the sets part: a set of K ranks in a world of P (default 16:4,32:8)",
    )
    parser.add_argument("--hosts", type=int, default=8, help="hosts of the bed (default 8)")
    parser.add_argument(
        "--per-host", default="1,2", help="ranks per host of the bed's jobs (default 1,2)"
    )
    parser.add_argument("--delay-us", type=float, default=25.0, help="link delay each way")
    parser.add_argument("--rate-gbit", type=float, default=10.0, help="link rate, Gbit/s")
    parser.add_argument(
        "--budget",
        type=float,
        default=0.3,
        help="seconds of timed iterations per case and implementation on the bed",
    )
    parser.add_argument("--json", metavar="PATH", help="write every measurement as JSON")
    parser.add_argument(
        "--measured",
        metavar="PATH",
        help="take the counts and the bed from an earlier run's --json instead of measuring "
        "them again (to fit and print the model)",
    )


def run(args: argparse.Namespace) -> int:
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"ringplug-bench scale: unknown parts {unknown}; choose from {PARTS}")
    sizes = sorted({int(p) for p in args.ranks.split(",") if p.strip()})
    sizes = [p for p in sizes if 2 <= p <= args.max_ranks]
    document: dict = {"bench": "scale", "env": _environment(), "parts": parts}
    if args.measured:
        earlier = json.loads(Path(args.measured).read_text())
        kept = ("counts", "calls", "sets", "bed", "pmpi")
        document.update({k: earlier[k] for k in kept if k in earlier})
        document["measured"] = {"from": args.measured, "env": earlier.get("env")}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ringplug-bench-scale-") as tmp:
        workdir = Path(tmp)
        if ("counts" in parts or "cpu" in parts or "model" in parts) and not args.measured:
            library, why = build_profiler(workdir)
            document["pmpi"] = str(PROFILER) if library else f"not used: {why}"
            document["counts"] = {
                str(p): count_job(p, args.steps, args.cpu_steps, workdir / f"counts-{p}", library)
                for p in sizes
            }
            if "cpu" in parts or "model" in parts:
                document["calls"] = {
                    str(p): call_job(p, args.steps, workdir / f"calls-{p}") for p in sizes
                }
        if "counts" in parts and "counts" in document:
            print_counts(document["counts"], document["pmpi"])
        if "cpu" in parts and "calls" in document:
            print_cpu(document)
        if "sets" in parts:
            if not args.measured:
                document["sets"] = set_jobs(args, workdir)
            print_sets(document.get("sets", []))
        if "bed" in parts:
            if not args.measured:
                document["bed"] = bed_jobs(args, workdir)
            print_bed(document.get("bed", {"skipped": "not in the earlier run"}))
        if "model" in parts:
            fit = fit_points(document)
            document["model"] = print_model(fit)
    document["seconds"] = round(time.perf_counter() - started, 1)
    print(f"# ringplug-bench scale took {document['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        print(f"# wrote {args.json}")
    return 0


def _environment() -> dict:
    from importlib import metadata

    load = os.getloadavg()
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "load": [round(x, 2) for x in load],
        "python": sys.version.split()[0],
        "mpich": _version(metadata, "mpich"),
        "mpi4py": _version(metadata, "mpi4py"),
        "torch": _version(metadata, "torch"),
    }


def _version(metadata, name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------ counts
def build_profiler(where: Path) -> tuple[Path | None, str]:
    """The MPI profiling library built against this virtualenv's MPI, or None and why not."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    include, lib = Path(sys.prefix) / "include", Path(sys.prefix) / "lib"
    if not PROFILER.exists():
        return None, f"{PROFILER} is not here (a source checkout has it)"
    if compiler is None or not (include / "mpi.h").exists() or not (lib / "libmpi.so").exists():
        return None, f"no C compiler, or no MPI headers and library in {sys.prefix}"
    built = where / "libcount_sends.so"
    result = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", f"-I{include}", "-o", str(built), str(PROFILER),
         f"-L{lib}", f"-Wl,-rpath,{lib}", "-lmpi"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        return None, f"the profiling library did not build: {result.stderr[-500:]}"
    return built, ""


def count_job(ranks: int, steps: int, cpu_steps: int, outdir: Path, library: Path | None) -> dict:
    """One job of `ranks` ranks on this machine: every rank's counts, and the profiling
    library's (tag -> [messages, bytes] per phase) where it was preloaded."""
    outdir.mkdir(parents=True)
    preload = ["env", f"LD_PRELOAD={library}"] if library else []
    command = [sys.executable, "-m", "ringplug.run.cli", "-np", str(ranks), *preload,
               sys.executable, "-m", "ringplug.bench.scale_job", "counts", str(outdir),
               str(steps), str(cpu_steps)]  # fmt: skip
    started = time.perf_counter()
    _run_job(command, f"the counts job on {ranks} ranks")
    reports = [json.loads((outdir / f"counts-{rank}.json").read_text()) for rank in range(ranks)]
    _add_profiled_sends(reports, outdir, library)
    print(f"# counts job on {ranks} ranks: {time.perf_counter() - started:.1f} s", flush=True)
    return {"ranks": ranks, "reports": reports}


def call_job(ranks: int, steps: int, outdir: Path) -> dict:
    """One job of `ranks` ranks counting the function calls of the small steps (no
    profiling library: its calls would be counted too)."""
    outdir.mkdir(parents=True)
    command = [sys.executable, "-m", "ringplug.run.cli", "-np", str(ranks),
               sys.executable, "-m", "ringplug.bench.scale_job", "calls", str(outdir),
               str(max(steps, 5))]  # fmt: skip
    started = time.perf_counter()
    _run_job(command, f"the calls job on {ranks} ranks")
    reports = [json.loads((outdir / f"calls-{rank}.json").read_text()) for rank in range(ranks)]
    print(f"# calls job on {ranks} ranks: {time.perf_counter() - started:.1f} s", flush=True)
    return {"ranks": ranks, "reports": reports}


def _add_profiled_sends(reports: list[dict], outdir: Path, library: object) -> None:
    """Each rank's sends as the preloaded profiling library counted them (its
    OUTDIR/sends-RANK.txt, one line per destination: peer, messages, bytes), as
    ``report["pmpi"]``; nothing without the library."""
    for report in reports:
        sends = outdir / f"sends-{report['rank']}.txt"
        if library and sends.exists():
            lines = [line.split() for line in sends.read_text().splitlines() if line]
            report["pmpi"] = {
                "messages": sum(int(m) for _, m, _ in lines),
                "bytes": sum(int(b) for _, _, b in lines),
            }


# ------------------------------------------------------------------------------ sets
def set_jobs(args: argparse.Namespace, workdir: Path) -> list[dict]:
    """For each P:K of ``--sets``: a set of K ranks in a world of P, and a set of all K
    ranks of a world of K, each a job of its own."""
    pairs = []
    for pair in args.sets.split(","):
        if pair.strip():
            p, k = (int(n) for n in pair.split(":"))
            if not 2 <= k <= p or p % k:
                raise SystemExit(
                    f"ringplug-bench scale: --sets {pair}: K must be at least 2 and divide P"
                )
            pairs += [(k, k), (p, k)]
    library, why = build_profiler(workdir)
    found = []
    for p, k in dict.fromkeys(pairs):  # the worlds of K first, each once
        outdir = workdir / f"sets-{p}-{k}"
        outdir.mkdir()
        preload = ["env", f"LD_PRELOAD={library}"] if library else []
        command = [sys.executable, "-m", "ringplug.run.cli", "-np", str(p), *preload,
                   sys.executable, "-m", "ringplug.bench.scale_job", "sets", str(outdir),
                   str(args.steps), str(k)]  # fmt: skip
        started = time.perf_counter()
        _run_job(command, f"the sets job (a set of {k} in {p} ranks)")
        reports = sorted(
            (json.loads(path.read_text()) for path in outdir.glob("sets-*.json")),
            key=lambda report: report["rank"],
        )
        _add_profiled_sends(reports, outdir, library)
        print(
            f"# sets job, a set of {k} in {p} ranks: {time.perf_counter() - started:.1f} s",
            flush=True,
        )
        found.append({"ranks": p, "set": k, "pmpi": why or "used", "reports": reports})
    return found


def print_sets(jobs: list[dict]) -> None:
    print(
        "# sets: per member per step, the set's engine (max over members in brackets); pmpi: "
        "the profiling library's count of every send of the process against the set "
        "engine's, every member; world: messages the world's engine sent meanwhile"
    )
    print(
        f"#{'p':>4} {'k':>3} | {'8x4K msgs':>10} {'bytes':>9} {'cycles':>6} {'MPI coll':>8} | "
        f"{'1M msgs':>7} {'bytes':>9} | {'pmpi':>6} {'world':>5} | 8x4K msgs/cycle "
        "(2 ceil(log2 k))"
    )
    for job in jobs:
        p, k, reports = job["ranks"], job["set"], job["reports"]
        step, medium = (reports[0]["phases"][phase] for phase in ("8x4K", "1M"))
        most = max(_total(r["phases"]["8x4K"], "messages") for r in reports)
        world = max(sum(r["world_engine"].values()) for r in reports)
        print(
            f" {p:>4} {k:>3} | {_total(step, 'messages'):>4.1f} [{most:>3.0f}] "
            f"{_total(step, 'bytes'):>9.0f} {step['cycles']:>6.1f} "
            f"{_total(step, 'collectives'):>8.1f} | "
            f"{_total(medium, 'messages'):>7.1f} {_total(medium, 'bytes'):>9.0f} | "
            f"{_profiled(reports):>6} {world:>5} | "
            f"{_total(step, 'messages') / step['cycles']:.1f} ({2 * scale_model.rounds(k)})"
        )


def _run_job(command: list[str], what: str, env: dict | None = None) -> None:
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired as error:
        raise SystemExit(
            f"ringplug-bench scale: {what} did not end within {JOB_TIMEOUT_S} s:\n"
            f"{(error.stderr or b'')[-3000:].decode(errors='replace')}"
        ) from None
    if result.returncode != 0:
        raise SystemExit(
            f"ringplug-bench scale: {what} failed ({result.returncode}):\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        )


def _total(counts: dict, group: str) -> float:
    return sum(counts[group].values())


def _profiled(reports: list[dict]) -> str:
    """Whether the profiling library counted, on every rank, the sends the engine counted
    over the same window (every phase): "same" or the first difference."""
    if not all("pmpi" in report for report in reports):
        return "-"
    for report in reports:
        engine = {group: sum(report["window"][group].values()) for group in ("messages", "bytes")}
        if engine != report["pmpi"]:
            return f"r{report['rank']} {report['pmpi']['messages']}!={engine['messages']}"
    return "same"


def print_counts(jobs: dict, pmpi: str) -> None:
    print(
        "# counts: per rank per step, rank 0 (max over ranks in brackets); engine's own "
        "counts (Engine.traffic), point-to-point sends"
    )
    print(
        f"# MPI profiling library: {pmpi}; pmpi: its count of every phase's sends against "
        "the engine's, every rank"
    )
    print(
        "# old: the all-to-all negotiation's sends and bytes at the same step (issue 44; "
        "~: its p-1 extrapolated)"
    )
    header = (
        f"#{'p':>4} | {'8x4K msgs':>10} {'bytes':>9} {'cycles':>6} {'pmpi':>6} "
        f"{'MPI coll':>8} | {'old msgs':>8} {'old bytes':>9} | {'1M msgs':>7} {'bytes':>9} "
        f"{'old':>4} | {'16M msgs':>8} {'bytes':>10} | 8x4K msgs/cycle (target 2 ceil(log2 p))"
    )
    print(header)
    for key, job in jobs.items():
        p = int(key)
        reports = job["reports"]
        step, medium, large = (reports[0]["phases"][phase] for phase in ("8x4K", "1M", "16M"))
        most = max(_total(r["phases"]["8x4K"], "messages") for r in reports)
        pmpi_text = _profiled(reports)
        old = ALL_TO_ALL.get(p)
        old_msgs = f"{old[0]}" if old else f"~{p - 1}"
        old_bytes = f"{old[1] / 1e3:.0f}K" if old else f"~{(p - 1) * 32.8:.0f}K"
        old_medium = f"{old[2]}" if old else "-"
        print(
            f" {p:>4} | {_total(step, 'messages'):>4.1f} [{most:>3.0f}] "
            f"{_total(step, 'bytes'):>9.0f} {step['cycles']:>6.1f} {pmpi_text:>6} "
            f"{_total(step, 'collectives'):>8.1f} | {old_msgs:>8} {old_bytes:>9} | "
            f"{_total(medium, 'messages'):>7.1f} {_total(medium, 'bytes'):>9.0f} "
            f"{old_medium:>4} | {_total(large, 'messages'):>8.1f} "
            f"{_total(large, 'bytes'):>10.0f} | "
            f"{_total(step, 'messages') / step['cycles']:.1f} ({2 * scale_model.rounds(p)})"
        )


def print_cpu(document: dict) -> None:
    per_call = seconds_per_call(document)
    print(
        "# cpu: per small step of so many 4 KiB tensors (submissions included), median over "
        "ranks: the function calls (Python's and C's) made outside the engine's waits, "
        "counted, by part (inside the agreement, inside recursive doubling, the rest); the "
        "CPU outside the waits, measured (process CPU less the CPU polling in the waits); "
        "and the calls at the CPU a call costs where each rank has a core "
        f"({per_call * 1e9:.0f} ns), with measured / that (where ranks outnumber the cores, "
        "sharing them costs the rest)"
    )
    print(
        f"#{'p':>4} {'step':>6} | {'cycles':>6} {'agree':>5} {'data':>4} {'coll':>4} | "
        f"{'agree':>6} {'double':>6} {'rest':>6} | {'cpu us':>8} {'calls x cost us':>15} "
        f"{'ratio':>6} | {'waiting us':>10} | {'wall/step ms':>12}"
    )
    for key, job in document["calls"].items():
        counted = document.get("counts", {}).get(key, {}).get("reports", [])
        for phase in SMALL_PHASES:
            shape = job["reports"][0]["phases"][phase]
            parts = [
                _median([r["phases"][phase]["calls"][part] for r in job["reports"]])
                for part in ("agreement", "doubling", "rest")
            ]
            calls = sum(parts)
            rows = [r["phases"][phase] for r in counted if phase in r["phases"]]
            work = _median([_work_cpu(r) for r in rows]) if rows else math.nan
            waiting = _median([r["wait_cpu_s"] for r in rows]) if rows else math.nan
            wall = _median([r["wall_s"] for r in rows]) if rows else math.nan
            print(
                f" {int(key):>4} {phase:>6} | {shape['cycles']:>6.2f} "
                f"{shape['messages'].get(NEGOTIATION, 0.0):>5.1f} "
                f"{shape['messages'].get(DATA, 0.0):>4.1f} {_total(shape, 'collectives'):>4.1f} | "
                f"{parts[0]:>6.0f} {parts[1]:>6.0f} {parts[2]:>6.0f} | {work * 1e6:>8.1f} "
                f"{calls * per_call * 1e6:>15.1f} {work / (calls * per_call):>6.2f} | "
                f"{waiting * 1e6:>10.1f} | {wall * 1e3:>12.2f}"
            )


def _calls(phase: dict) -> float:
    return sum(phase["calls"].values())


def _work_cpu(phase: dict) -> float:
    """The process's CPU per step outside the engine's waits: the step's own work."""
    return max(phase["process_cpu_s"] - phase["wait_cpu_s"], 0.0)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


# ------------------------------------------------------------------------------ bed
def bed_jobs(args: argparse.Namespace, workdir: Path) -> dict:
    """The side-by-side jobs on a bed of `args.hosts` shaped hosts, or why there are none."""
    bed = NetBed(uniform_hosts(args.hosts), Shape(args.delay_us, args.rate_gbit))
    try:
        bed.start()
    except BedUnavailable as error:
        bed.stop()
        print(f"# bed: skipped, the multi-host bed is unavailable here: {error}")
        return {"skipped": str(error)}
    found: dict = {"hosts": args.hosts, "shaping": bed.shaping, "jobs": []}
    try:
        for per_host in [int(n) for n in args.per_host.split(",") if n.strip()]:
            outdir = workdir / f"bed-{per_host}"
            outdir.mkdir()
            spec = ",".join(f"{bed.address(h.key)}:{per_host}" for h in bed.hosts)
            command = bed.command(
                bed.hosts[0].key,
                [sys.executable, "-m", "ringplug.run.cli", "--ssh-config-file",
                 str(bed.ssh_config), "-H", spec, "-np", str(per_host * args.hosts),
                 # Over the bed's links, not the shared memory of the one real machine.
                 "-x", "UCX_TLS=tcp,self", "-x", "OMP_NUM_THREADS=1",
                 sys.executable, "-m", "ringplug.bench.scale_job", "bed", str(outdir),
                 str(args.budget)],
            )  # fmt: skip
            env = {k: v for k, v in os.environ.items() if k != "RINGPLUG_MPIEXEC"}
            started = time.perf_counter()
            _run_job(command, f"the bed job with {per_host} rank(s) per host", env)
            result = json.loads((outdir / "bed.json").read_text())
            result["per_host"] = per_host
            result["seconds"] = round(time.perf_counter() - started, 1)
            found["jobs"].append(result)
            print(f"# bed job, {per_host} per host: {result['seconds']} s", flush=True)
    finally:
        bed.stop()
    return found


def print_bed(bed: dict) -> None:
    if "skipped" in bed:
        return
    print(f"# bed: {bed['hosts']} hosts, links: {bed['shaping']}; median of the slowest rank")
    print(
        f"#{'ranks':>6} {'case':>9} | {'ringplug ms':>11} {'mpi ms':>9} {'gloo ms':>9} | "
        f"{'mpi/ringplug':>12} {'gloo/ringplug':>13} | path"
    )
    for job in bed["jobs"]:
        for row in job["rows"]:
            t = row["median_s"]
            gloo = t.get("gloo", math.nan)  # nan: no torch on the ranks
            print(
                f" {job['ranks']:>3}x{job['per_host']} {row['case']:>9} | "
                f"{t['ringplug'] * 1e3:>11.3f} {t['mpi'] * 1e3:>9.3f} {gloo * 1e3:>9.3f} | "
                f"{t['mpi'] / t['ringplug']:>12.2f} {gloo / t['ringplug']:>13.2f} | "
                f"{row['path']}"
            )


# ------------------------------------------------------------------------------ model
def mpi_collective(nbytes: float, ranks: int) -> tuple[float, float]:
    """Messages and bytes one rank sends in MPI's own allreduce of `nbytes` (modelled, not
    counted: MPI's internal sends bypass the profiling interface): recursive halving and
    doubling, 2 ceil(log2 p) messages and 2 n (p - 1) / p bytes."""
    return 2 * scale_model.rounds(ranks), 2 * nbytes * (ranks - 1) / ranks


def engine_point(label: str, counts: dict, ranks: int, nbytes: int, tensors: int,
                 seconds: float) -> Point:  # fmt: skip
    """A point from the engine's counts of one operation (per call)."""
    messages, sent = _total(counts, "messages"), _total(counts, "bytes")
    collectives = _total(counts, "collectives")
    if collectives:
        extra_messages, extra_bytes = mpi_collective(nbytes / collectives, ranks)
        messages += collectives * extra_messages
        sent += collectives * extra_bytes
    calls = tensors + counts["cycles"] + _total(counts, "messages") + collectives
    return Point(label, messages, sent, calls, seconds)


def step_points(document: dict, agreeing_only: bool = True) -> list[StepPoint]:
    """The call fit's points: each small step (1, 8 and 32 tensors of 4 KiB) that took one
    cycle (a step that took more also ran cycles where some rank had not submitted yet: a
    late rank's cost, not an agreed cycle's), the medians over ranks of its calls by part;
    with `agreeing_only`, only those of the jobs of more than `GATHER_ONLY_UP_TO` ranks
    (smaller ones gather every rank's form instead of agreeing, as large jobs do)."""
    points: list[StepPoint] = []
    for key, job in document.get("calls", {}).items():
        ranks = int(key)
        if agreeing_only and ranks <= GATHER_ONLY_UP_TO:
            continue
        for phase in SMALL_PHASES:
            rows = [r["phases"][phase] for r in job["reports"]]
            if _median([r["cycles"] for r in rows]) != 1.0:
                continue
            doubled = _median([r["calls"]["doubling"] for r in rows]) > 0
            points.append(
                StepPoint(
                    f"{phase} p={key}",
                    STEP_TENSORS[phase],
                    scale_model.rounds(ranks),
                    scale_model.rounds(ranks) if doubled else 0,
                    _median([r["calls"]["agreement"] for r in rows]),
                    _median([r["calls"]["doubling"] for r in rows]),
                    _median([r["calls"]["rest"] for r in rows]),
                )  # fmt: skip
            )
    return points


def seconds_per_call(document: dict) -> float:
    """The CPU one call costs: the CPU measured outside the waits over the calls counted,
    in the one-tensor step (whose calls are mostly the cycle's and its messages', MPI's
    among them: dearer than a tensor's, as the cpu part's ratios show) of the jobs whose
    ranks each had a core, their median."""
    cores = os.cpu_count() or 1
    one = SMALL_PHASES[0]
    ratios = []
    for key, job in document.get("calls", {}).items():
        counted = document.get("counts", {}).get(key)
        if int(key) > cores or not counted:
            continue
        calls = _median([_calls(r["phases"][one]) for r in job["reports"]])
        rows = [r["phases"][one] for r in counted["reports"] if one in r["phases"]]
        if rows and calls:
            ratios.append(_median([_work_cpu(r) for r in rows]) / calls)
    if not ratios:
        raise SystemExit(
            f"ringplug-bench scale: the CPU model needs a job of at most {cores} ranks (one "
            "core each) to measure what a call costs: add 2 to --ranks"
        )
    return _median(ratios)


def model_points(document: dict) -> list[Point]:
    """The wall-time fit's points: the counts jobs' phases where the ranks fit the cores,
    and every ringplug and MPI row of the bed."""
    points: list[Point] = []
    cores = os.cpu_count() or 1
    for key, job in document.get("counts", {}).items():
        p = int(key)
        if p <= cores:
            for phase in ("8x4K", "1M", "16M"):
                counts = job["reports"][0]["phases"][phase]
                wall = _median([r["phases"][phase]["wall_s"] for r in job["reports"]])
                points.append(
                    engine_point(
                        f"wall {phase} p={p}",
                        counts,
                        p,
                        STEP_BYTES[phase],
                        STEP_TENSORS[phase],
                        wall,
                    )  # fmt: skip
                )
    for job in document.get("bed", {}).get("jobs", []):
        p = job["ranks"]
        for row in job["rows"]:
            where = f"bed {row['case']} {p // job['per_host']}x{job['per_host']}"
            points.append(
                engine_point(
                    f"{where} ringplug",
                    row["ringplug_engine"],
                    p,
                    row["bytes"],
                    row["tensors"],
                    row["median_s"]["ringplug"],
                )  # fmt: skip
            )
            messages, sent = mpi_collective(row["bytes"] / row["tensors"], p)
            points.append(
                Point(
                    f"{where} mpi",
                    messages * row["tensors"],
                    sent * row["tensors"],
                    row["tensors"],
                    row["median_s"]["mpi"],
                )  # fmt: skip
            )
    return points


def fit_points(document: dict) -> tuple[Fit, CpuModel]:
    """The wall-time fit and the CPU model."""
    wall, steps = model_points(document), step_points(document)
    if not steps:
        print(
            f"# no job of more than {GATHER_ONLY_UP_TO} ranks agreed a step in one cycle: the "
            "call fit takes the smaller jobs' steps, which gather every rank's form instead "
            "of agreeing (add 8 or more to --ranks for what large jobs do)"
        )
        steps = step_points(document, agreeing_only=False)
    if not wall or not steps:
        raise SystemExit("ringplug-bench scale: the model needs the counts part's points")
    per_call = seconds_per_call(document)
    return scale_model.fit_model(wall), CpuModel(scale_model.fit_calls(steps), per_call)


def _print_errors(errors: dict[str, float], terms: int) -> None:
    for label, error in errors.items():
        print(f"#   {label:<36} {error:+.0%}")
    if len(errors) <= terms:
        print(
            "#   (no more points than terms: the fit is underdetermined, not a test of the model)"
        )


def print_model(fits: tuple[Fit, CpuModel]) -> dict:
    wall, cpu = fits
    rate = f"{1 / wall.beta / 1e9:.2f} GB/s" if wall.beta else "no cost per byte"
    print(
        "# models: least squares of the relative error, coefficients >= 0; error on the "
        "points (predicted / measured - 1)"
    )
    print(
        f"# wall-time fit, seconds = alpha * messages + beta * bytes + gamma * Python calls: "
        f"alpha = {wall.alpha * 1e6:.2f} us/message, beta = {wall.beta * 1e9:.3f} ns/byte "
        f"({rate}), gamma = {wall.gamma * 1e6:.2f} us/call; rms {wall.rms_error:.0%}:"
    )
    _print_errors(wall.errors, 3)
    fit = cpu.calls
    print(
        "# call fit, on the steps agreed in one cycle by jobs of more than "
        f"{GATHER_ONLY_UP_TO} ranks (smaller ones gather every rank's form instead of "
        "agreeing): calls outside the waits by part, rest = a + b * tensors, agreement = "
        "c + d * rounds, recursive doubling = e * rounds (all its calls over its rounds): "
        f"a = {fit.per_cycle:.1f}, b = {fit.per_tensor:.1f}, c = {fit.agreement_once:.1f}, "
        f"d = {fit.agreement_per_round:.1f}, e = {fit.doubling_per_round:.1f}; rms "
        f"{fit.rms_error:.0%}:"
    )
    _print_errors(fit.errors, 4)
    print(
        f"# CPU per call: {cpu.seconds_per_call * 1e9:.0f} ns (the one-tensor step where each "
        "rank had a core; the cpu part shows the others)"
    )
    for p in (64, 512, 4096):
        cost = [
            scale_model.engine_cpu_per_cycle(cpu, p, tensors, doubling) * 1e6
            for tensors in (1, 8)
            for doubling in (False, True)
        ]
        print(
            f"# predicted engine CPU per agreed cycle at {p} ranks (target at 512: under 100 "
            f"us), the data by MPI's allreduce / by recursive doubling: {cost[0]:.1f} / "
            f"{cost[1]:.1f} us with 1 tensor, {cost[2]:.1f} / {cost[3]:.1f} us with 8 (of "
            f"which {fit.per_tensor * 8 * cpu.seconds_per_call * 1e6:.1f} us the tensors', "
            "the same at any p)"
        )
    found = scale_model.predictions(wall, cpu)
    print(
        "# predicted (modelled, not measured): per step; efficiency = compute / (compute + "
        "overhead), the data plane overlapping the backward pass except its last buffer; "
        "control: the cycles' latency and CPU, and every tensor's CPU"
    )
    print(
        f"# {'setting':<44} {'p':>5} | {'engine cpu/cycle us':>19} {'control ms':>10} "
        f"{'data ms':>8} {'overhead ms':>11} | {'efficiency':>10} {'no overlap':>10}"
    )
    for row in found:
        print(
            f"  {row.setting:<44} {row.ranks:>5} | {row.engine_cpu_per_cycle_s * 1e6:>19.1f} "
            f"{row.control_s * 1e3:>10.2f} {row.data_s * 1e3:>8.1f} "
            f"{row.step_overhead_s * 1e3:>11.1f} | {row.efficiency:>10.1%} "
            f"{row.efficiency_no_overlap:>10.1%}"
        )
    print(
        f"# Horovod's published: {scale_model.HOROVOD_EFFICIENCY:.0%} at 512 GPUs "
        "(ResNet-101, Inception V3)"
    )
    for model in (*scale_model.HOROVOD_MODELS, scale_model.CPU_JOB):
        print(
            f"#   {model.name}: {model.parameters:,} parameters in {model.tensors} tensors, "
            f"{model.compute_s * 1e3:.0f} ms compute per step ({model.source})"
        )
    for network in (scale_model.ROCE, scale_model.CPU_LINK):
        print(f"#   {network.name}: {network.source}")
    return {
        "wall": {
            "alpha_s": wall.alpha,
            "beta_s_per_byte": wall.beta,
            "gamma_s": wall.gamma,
            "errors": wall.errors,
            "rms_error": wall.rms_error,
        },
        "cpu": {
            "calls_per_cycle": fit.per_cycle,
            "calls_per_tensor": fit.per_tensor,
            "agreement_calls_once": fit.agreement_once,
            "agreement_calls_per_round": fit.agreement_per_round,
            "doubling_calls_per_round": fit.doubling_per_round,
            "errors": fit.errors,
            "rms_error": fit.rms_error,
            "seconds_per_call": cpu.seconds_per_call,
        },
        "predictions": [row.__dict__ for row in found],
    }
