"""Chaos runs: elastic jobs that lose a random rank at a random step, one after another.

    python tests/measure_chaos.py [--runs 20] [--seed S] [--kind lightning|hvd]
                                  [--rank R --step K]

Each run is one ``ringrun -np 3 --max-restarts 2 --min-np 2 --host-discovery-script ...``
job (the script names 3 slots, then 2) whose victim rank SIGKILLs itself at a step drawn
from ``--seed`` (printed, so a run can be repeated): a Lightning fit
(tests/workers/lightning_elastic.py ``kill``: ``last.ckpt`` every 2 steps) or a Horovod-style
elastic torch training (tests/workers/hvd_elastic.py: a commit every 3 batches), in turn
unless ``--kind`` says which. A run passes when:

- ringrun exits with 0 after one restart, on 2 ranks;
- the restart resumed from the last checkpoint (commit) written before the kill: the step
  and weights it began with are those the ledger shows there;
- the ledger is complete: each sample of every epoch trained once by what was checkpointed
  plus what the restart trained (nothing skipped); the samples trained twice are only those
  of the steps after that checkpoint;
- the ranks of the restart end with identical weights, and the loss went on falling (the
  last epoch's mean below the first's).

Prints one line per run and a summary: passes, and the median time from the kill to the
restart's first step. Not a test; tests/test_chaos.py runs one random run with these
functions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from launch import discovery_script

HERE = Path(__file__).parent
WORKERS = HERE / "workers"
RINGRUN = [sys.executable, "-m", "ringplug.run.cli"]
KINDS = ("lightning", "hvd")
RANKS, RANKS_AFTER = 3, 2
RUN_TIMEOUT_S = 300

# The Lightning job: 72 samples, batches of 4, 3 epochs (6 steps each on 3 ranks), a
# checkpoint every 2 steps. Its victim dies before step K, with K - 1 steps done.
LIGHTNING_SAMPLES, LIGHTNING_EPOCHS, LIGHTNING_EVERY = 72, 3, 2
LIGHTNING_STEPS = (3, 17)  # K: a checkpoint was written, and the fit is not over
# The Horovod job: 240 samples, batches of 4, 2 epochs (20 batches each on 3 ranks), a
# commit every 3 batches and at each epoch's end. Its victim dies after its K-th batch.
HVD_SAMPLES, HVD_EPOCHS, HVD_BATCH = 240, 2, 4
HVD_STEPS = (4, 39)


@dataclass(frozen=True)
class Chaos:
    """One chaos run: which job, and which rank dies at which step."""

    kind: str
    rank: int
    step: int

    def describe(self) -> str:
        when = "before step" if self.kind == "lightning" else "after batch"
        return f"{self.kind:9} rank {self.rank} killed {when} {self.step:2}"


@dataclass
class Verdict:
    """What one run showed: its problems (none: it passed) and its figures."""

    problems: list[str] = field(default_factory=list)
    resumed_at: int | None = None  # the step (Lightning) or commit (Horovod) resumed from
    trained_twice: int = 0  # samples of the lost steps, trained again by the restart
    losses: tuple[float, float] | None = None  # mean loss of the first and the last epoch
    kill_to_first_step_s: float | None = None

    def check(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok


def draw(rng: random.Random, kind: str) -> Chaos:
    """A victim rank and step for a `kind` job."""
    low, high = LIGHTNING_STEPS if kind == "lightning" else HVD_STEPS
    return Chaos(kind, rng.randrange(RANKS), rng.randint(low, high))


def run_chaos(chaos: Chaos, folder: Path, marker: str = "measure-chaos") -> tuple[Verdict, str]:
    """Run `chaos` in `folder` (empty) and judge it; returns the verdict and ringrun's
    output."""
    worker = WORKERS / ("lightning_elastic.py" if chaos.kind == "lightning" else "hvd_elastic.py")
    args = ["kill", str(folder), "0"] if chaos.kind == "lightning" else [str(folder)]
    three_then_two = discovery_script(folder, "localhost:3", "localhost:2")
    command = [
        *RINGRUN,
        "-np",
        str(RANKS),
        "--max-restarts",
        "2",
        "--min-np",
        str(RANKS_AFTER),
        "--host-discovery-script",
        str(three_then_two),
        sys.executable,
        str(worker),
        *args,
        marker,
    ]
    env = {name: value for name, value in os.environ.items() if name != "RINGPLUG_MPIEXEC"}
    env.update(
        ELASTIC_KILL_RANK=str(chaos.rank),
        ELASTIC_KILL_STEP=str(chaos.step),
        RINGPLUG_TIMEOUT="30",
        TMPDIR=str(folder),  # hvd.elastic's commits, which ringrun removes at the end
    )
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except subprocess.TimeoutExpired as expired:
        output = f"{expired.stdout or ''}{expired.stderr or ''}"
        return Verdict([f"ringrun did not end within {RUN_TIMEOUT_S} s"]), str(output)
    output = done.stdout + done.stderr
    verdict = Verdict()
    verdict.check(done.returncode == 0, f"ringrun exited with {done.returncode}")
    restarts = [line for line in done.stderr.splitlines() if line.startswith("ringrun: restart ")]
    if verdict.check(len(restarts) == 1, f"{len(restarts)} restart lines, not 1: {restarts}"):
        verdict.check(
            f"after rank {chaos.rank} " in restarts[0] and "2 ranks on localhost:2" in restarts[0],
            f"the restart line blames another rank or runs elsewhere: {restarts[0]}",
        )
    if verdict.problems:
        return verdict, output
    try:
        if chaos.kind == "lightning":
            judge_lightning(folder, verdict, last_done=chaos.step - 1)
        else:
            judge_hvd(folder, verdict, chaos)
    except (OSError, ValueError, KeyError, IndexError) as error:  # a file missing or torn
        verdict.problems.append(f"{type(error).__name__}: {error}")
    return verdict, output


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _ids(records: list[dict]) -> Counter:
    return Counter(i for record in records for i in record["ids"])


def judge_lightning(
    folder: Path,
    verdict: Verdict,
    last_done: int,
    ranks: int = RANKS,
    ranks_after: int = RANKS_AFTER,
) -> Verdict:
    """Judge a lightning_elastic.py job that lost ranks after step `last_done` of its first
    start (`ranks` ranks) and ended in its second (`ranks_after`)."""
    first = [_jsonl(folder / f"ledger.0.{rank}.jsonl") for rank in range(ranks)]
    again = [_jsonl(folder / f"ledger.1.{rank}.jsonl") for rank in range(ranks_after)]
    reports = [json.loads((folder / f"done.1.{r}.json").read_text()) for r in range(ranks_after)]
    verdict.check(
        not list(folder.glob("done.0.*")) and not list(folder.glob("ledger.2.*")),
        "the first start ended a fit, or there was a second restart",
    )
    # last.ckpt is written every 2 steps, by rank 0 before the save's barrier: the one of
    # the last even step the lost rank finished is there.
    expected = last_done - last_done % LIGHTNING_EVERY
    saved = reports[0]["began"]["step"]
    verdict.resumed_at = saved
    verdict.check(
        [r["began"]["step"] for r in reports] == [expected] * ranks_after,
        f"the restart began at steps {[r['began']['step'] for r in reports]}, not at the "
        f"last checkpoint (step {expected})",
    )
    at_save = [r for r in first[0] if r["step"] == saved]
    verdict.check(
        bool(at_save) and all(r["began"]["weights"] == at_save[0]["weights"] for r in reports),
        f"the restart did not begin with the weights of step {saved}",
    )
    for epoch in range(LIGHTNING_EPOCHS):
        kept = [r for walk in first for r in walk if r["epoch"] == epoch and r["step"] <= saved]
        after = [r for walk in again for r in walk if r["epoch"] == epoch]
        trained = _ids(kept + after)
        verdict.check(
            trained == Counter(range(LIGHTNING_SAMPLES)),
            f"epoch {epoch}: samples skipped {sorted(set(range(LIGHTNING_SAMPLES)) - set(trained))}"
            f", trained twice {sorted(i for i, n in trained.items() if n > 1)}",
        )
    lost = [r for walk in first for r in walk if r["step"] > saved]
    verdict.trained_twice = sum(len(r["ids"]) for r in lost)
    verdict.check(
        all(r["step"] <= last_done for r in lost),
        f"steps after {last_done} were trained before the restart: "
        f"{sorted({r['step'] for r in lost})}",
    )
    verdict.check(
        len({json.dumps(r["weights"]) for r in reports}) == 1,
        "the ranks of the restart ended with different weights",
    )
    verdict.check(
        reports[0]["world"] == ranks_after, f"the restart ran {reports[0]['world']} ranks"
    )
    epoch_0 = [r for walk in first for r in walk if r["epoch"] == 0 and r["step"] <= saved]
    epoch_0 += [r for walk in again for r in walk if r["epoch"] == 0]
    last_epoch = [r for walk in again for r in walk if r["epoch"] == LIGHTNING_EPOCHS - 1]
    _judge_losses(verdict, epoch_0, last_epoch)
    kill, times = folder / "kill.json", folder / "times.1.json"
    if kill.exists() and times.exists():
        killed = json.loads(kill.read_text())["time"]
        verdict.kill_to_first_step_s = json.loads(times.read_text())["first_step"] - killed
    return verdict


def judge_hvd(folder: Path, verdict: Verdict, chaos: Chaos) -> Verdict:
    """Judge an hvd_elastic.py job whose rank `chaos.rank` died after batch `chaos.step`."""
    first = [_jsonl(folder / f"batches.0.{rank}") for rank in range(RANKS)]
    again = [_jsonl(folder / f"batches.1.{rank}") for rank in range(RANKS_AFTER)]
    starts = [json.loads((folder / f"start.1.{r}").read_text()) for r in range(RANKS_AFTER)]
    verdict.check(
        not list(folder.glob("final.0.*")) and not list(folder.glob("batches.2.*")),
        "the first start ended its training, or there was a second restart",
    )
    # The victim dies after its batch's allreduce, before the commit that may follow it: no
    # rank made a commit before the victim's last one ended, and the others may make one
    # more, which includes that batch (every rank's gradients are in it). Rank 0 writes them.
    victims = first[chaos.rank][-1]["commits"]
    verdict.check(len(first[chaos.rank]) == chaos.step, "the victim died at another batch")
    written = [line["commit"] for line in _jsonl(folder / "ledger.0.0")] or [0]
    resumed = starts[0]["commits"]
    verdict.resumed_at = resumed
    verdict.check(
        all(s["commits"] == resumed for s in starts)
        and resumed in (victims, victims + 1)
        and resumed >= max(written),
        f"the restart resumed from commits {[s['commits'] for s in starts]}, not from the "
        f"last one rank 0 wrote ({max(written)}; the victim's last, {victims})",
    )
    verdict.check(starts[0]["size"] == RANKS_AFTER, f"the restart ran {starts[0]['size']} ranks")
    for epoch in range(HVD_EPOCHS):
        kept = [r for walk in first for r in walk if r["epoch"] == epoch and r["commits"] < resumed]
        after = [r for walk in again for r in walk if r["epoch"] == epoch]
        trained = _ids(kept + after)
        skipped = sorted(set(range(HVD_SAMPLES)) - set(trained))
        # An epoch's samples not a multiple of the ranks' batch are padded by repeating a few.
        padding = sum(trained.values()) - HVD_SAMPLES
        verdict.check(
            not skipped and 0 <= padding < RANKS_AFTER * HVD_BATCH,
            f"epoch {epoch}: samples skipped {skipped}, {padding} trained twice",
        )
    lost = [r for walk in first for r in walk if r["commits"] >= resumed]
    verdict.trained_twice = sum(len(r["ids"]) for r in lost)
    finals = {(folder / f"final.1.{r}").read_text() for r in range(RANKS_AFTER)}
    verdict.check(len(finals) == 1, "the ranks of the restart ended with different weights")
    verdict.check(
        not list(folder.glob("ringplug-elastic-*")), "ringrun left the job's commits behind"
    )
    epoch_0 = [r for walk in first for r in walk if r["epoch"] == 0 and r["commits"] < resumed]
    epoch_0 += [r for walk in again for r in walk if r["epoch"] == 0]
    last_epoch = [r for walk in again for r in walk if r["epoch"] == HVD_EPOCHS - 1]
    _judge_losses(verdict, epoch_0, last_epoch)
    killed = json.loads((folder / "kill.json").read_text())["time"]
    verdict.kill_to_first_step_s = again[0][0]["time"] - killed
    return verdict


def _judge_losses(verdict: Verdict, first_epoch: list[dict], last_epoch: list[dict]) -> None:
    """The loss went on falling across the restart: the last epoch's mean below the first's."""
    if not first_epoch or not last_epoch:
        verdict.problems.append("no loss recorded for the first or the last epoch")
        return
    means = (
        statistics.fmean(r["loss"] for r in first_epoch),
        statistics.fmean(r["loss"] for r in last_epoch),
    )
    verdict.losses = means
    verdict.check(means[1] < means[0], f"the loss rose: {means[0]:.3g} -> {means[1]:.3g}")


def line(number: int, runs: int, chaos: Chaos, verdict: Verdict, took_s: float) -> str:
    """One row of the report: the run, pass or what failed, and its figures."""
    state = "pass" if not verdict.problems else "FAIL"
    where = "step" if chaos.kind == "lightning" else "commit"
    figures = []
    if verdict.resumed_at is not None:
        figures.append(f"resumed at {where} {verdict.resumed_at:2}")
        figures.append(f"{verdict.trained_twice:2} samples trained twice")
    if verdict.losses is not None:
        figures.append(f"loss {verdict.losses[0]:.3g} -> {verdict.losses[1]:.3g}")
    if verdict.kill_to_first_step_s is not None:
        figures.append(f"kill->first step {verdict.kill_to_first_step_s:5.2f} s")
    text = f"run {number:2}/{runs}  {chaos.describe()}  {state}  {took_s:5.1f} s  "
    text += ", ".join(figures)
    if verdict.problems:
        text += "\n    " + "\n    ".join(verdict.problems)
    return text


def _median(spans: list[float]) -> str:
    return f"{statistics.median(spans):.2f} s" if spans else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="default: from the time")
    parser.add_argument("--kind", choices=KINDS, default=None, help="default: in turn")
    parser.add_argument("--rank", type=int, default=None, help="the victim (default: drawn)")
    parser.add_argument("--step", type=int, default=None, help="its step (default: drawn)")
    parser.add_argument("--keep", action="store_true", help="keep each run's folder")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else time.time_ns() % 1_000_000
    rng = random.Random(seed)
    print(f"seed {seed} (repeat with --seed {seed})", flush=True)
    passed, spans = 0, {kind: [] for kind in KINDS}
    for number in range(1, args.runs + 1):
        kind = args.kind or KINDS[(number - 1) % len(KINDS)]
        drawn = draw(rng, kind)
        chaos = Chaos(
            kind,
            drawn.rank if args.rank is None else args.rank,
            drawn.step if args.step is None else args.step,
        )
        folder = Path(tempfile.mkdtemp(prefix=f"ringplug-chaos-{number}-"))
        began = time.monotonic()
        verdict, output = run_chaos(chaos, folder)
        print(line(number, args.runs, chaos, verdict, time.monotonic() - began), flush=True)
        if verdict.problems:
            (folder / "ringrun.out").write_text(output)
            print(f"    output and files kept in {folder}", flush=True)
        else:
            passed += 1
            if verdict.kill_to_first_step_s is not None:
                spans[kind].append(verdict.kill_to_first_step_s)
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    every = [span for kind in KINDS for span in spans[kind]]
    each = ", ".join(f"{kind} {_median(spans[kind])}" for kind in KINDS if spans[kind])
    print(
        f"{passed}/{args.runs} passed (seed {seed}); kill -> first step after the restart: "
        f"median {_median(every)} over {len(every)} runs ({each})"
    )
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
