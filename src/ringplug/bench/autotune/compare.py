"""`ringplug-bench autotune`: autotune from a bad setting against the best of a hand-picked
sweep, side by side in one job.

Run under ringrun (``ringrun -np 2 ringplug-bench autotune --workload fusion``). One job
trains, every rank alike, in segments of steps:

1. ``--warmup`` steps at the bad setting (fusion threshold 64 KiB, cycle time 20 ms);
2. tuning: `ringplug.core.autotune.tune_from` the bad setting, with the settings' budget
   (``RINGPLUG_AUTOTUNE_*``: by default at most 48 steps), for ``--tuning-steps`` steps;
   the tuner reports the steps it used and whether it converged;
3. ``--rounds`` rounds in which the bad setting, each setting of the hand-picked sweep
   (:data:`SWEEP`) and the tuned setting run ``--iters`` timed steps each (after one untimed
   step that pays for the switch), the order rotated each round, so that a change of the
   machine's load falls on every setting alike.

A step's time is the slowest rank's. It reports each setting's median step time, the tuned
setting's throughput against the best of the sweep (target: at least 0.9) and the tuning
steps used (target: at most 50).

Workloads: ``fusion`` submits ResNet-50's gradients (161 tensors, 102 MB) asynchronously in
backward order, as `ringplug-bench fusion` does; ``lightning`` fits an MLP (``--hidden``) with
`RingStrategy` (gradient buckets of ``--bucket-bytes``, 1 MiB: several a step) on
synthetic data, one torch thread per rank, per-rank batch 32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

import ringplug
from ringplug.core import autotune, runtime
from ringplug.core.autotune import Candidate

from ..fusion import resnet50_shapes

BAD = Candidate(64 << 10, 20.0)
"""Where autotune starts: the issue's bad setting."""

SWEEP = (
    Candidate(1 << 20, 0.0),
    Candidate(4 << 20, 0.0),
    Candidate(16 << 20, 0.0),
    Candidate(64 << 20, 0.0),
    Candidate(128 << 20, 0.0),
    Candidate(64 << 20, 1.0),
    Candidate(64 << 20, 5.0),
)
"""The hand-picked sweep: ringplug's default (64 MiB, 0 ms) and its neighbours."""

TUNED = "autotuned"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("fusion", "lightning"), default="fusion")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per setting per round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of the side-by-side part")
    parser.add_argument(
        "--tuning-steps",
        type=int,
        default=60,
        help="steps given to tuning (it stops by itself within its budget: 48 by default)",
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="steps at the bad setting before tuning starts"
    )
    parser.add_argument("--hidden", type=int, default=1024, help="lightning: MLP width")
    parser.add_argument(
        "--bucket-bytes",
        type=int,
        default=1 << 20,
        help="lightning: RingStrategy's gradient buckets (1 MiB: several a step, so the "
        "fusion threshold matters)",
    )
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")


def _label(candidate: Candidate) -> str:
    return f"{candidate.fusion_threshold >> 10}K/{candidate.cycle_time_ms:g}ms"


class Schedule:
    """The job's segments of steps, and the clock of each step; driven step by step by a
    loop (fusion) or a Lightning callback (`before` and `after` each step)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.engine = runtime.engine()
        self.iters, self.rounds = args.iters, args.rounds
        # (label, setting, steps); "tune" starts tuning, TUNED applies the tuned setting.
        self.segments: list[tuple[str, Candidate | str, int]] = [
            ("warmup", BAD, args.warmup),
            ("tuning", "tune", args.tuning_steps),
        ]
        labels: list[tuple[str, Candidate | str]] = [(_label(BAD), BAD)]
        labels += [(_label(c), c) for c in SWEEP]
        labels.append((TUNED, TUNED))
        for turn in range(args.rounds):
            shift = turn % len(labels)
            for label, setting in labels[shift:] + labels[:shift]:
                self.segments.append((label, setting, 1 + args.iters))
        self.starts: dict[int, tuple[str, Candidate | str, int]] = {}
        step = 0
        for segment in self.segments:
            self.starts[step] = segment
            step += segment[2]
        self.total = step
        self.times: dict[str, list[float]] = {}
        self.tuning_seconds = 0.0
        self._label, self._first, self._started = "", 0, 0.0
        self.tuned: Candidate | None = None
        self.tuner: autotune.Autotuner | None = None

    def before(self, step: int) -> None:
        if step in self.starts:
            if self._label == "tuning":
                self.tuning_seconds = time.perf_counter() - self._tuning_start
            label, setting, _ = self.starts[step]
            ringplug.barrier()  # nothing in flight on any rank: change the setting here
            if setting == "tune":
                self.tuner = autotune.tune_from(
                    self.engine, BAD.fusion_threshold, BAD.cycle_time_ms * 1e-3
                )
                self._tuning_start = time.perf_counter()
            else:
                if setting == TUNED:
                    setting = self._tuned()
                assert isinstance(setting, Candidate)
                self.engine.apply_tuned_setting(
                    setting.fusion_threshold, setting.cycle_time_ms * 1e-3
                )
            self._label, self._first = label, step
        self._started = time.perf_counter()

    def after(self, step: int) -> None:
        if self._label in ("warmup", "tuning") or step == self._first:
            return  # the first step of a segment pays for the switch
        self.times.setdefault(self._label, []).append(time.perf_counter() - self._started)

    def _tuned(self) -> Candidate:
        if self.tuned is None:
            tuner = self.tuner
            assert tuner is not None and tuner.search is not None
            done = ringplug.allreduce(np.array([int(tuner.done)]), op=ringplug.Min)
            if not done[0]:
                raise SystemExit(
                    "ringplug-bench autotune: tuning had not ended after --tuning-steps "
                    f"{self.segments[1][2]} steps; give it more"
                )
            assert tuner.search.best is not None
            self.tuned = tuner.search.best
        return self.tuned

    def slowest(self) -> dict[str, list[float]]:
        """Each setting's step times, the slowest rank's (the same steps on every rank)."""
        return {
            label: list(ringplug.allreduce(np.array(times), op=ringplug.Max))
            for label, times in sorted(self.times.items())
        }


def _fusion_steps(schedule: Schedule) -> None:
    rank = ringplug.rank()
    backward = list(reversed(resnet50_shapes()))
    arrays = [np.full(shape, rank + 1.0, np.float32) for _, shape in backward]
    # Averaged in place, step after step: the values stay finite (a sum would overflow).
    for step in range(schedule.total):
        schedule.before(step)
        handles = [
            ringplug.allreduce_async(t, op=ringplug.Average, out=t, name=name)
            for (name, _), t in zip(backward, arrays, strict=True)
        ]
        for handle in handles:
            handle.wait()
        schedule.after(step)


def _lightning_steps(schedule: Schedule, hidden: int, bucket_bytes: int) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ringplug.lightning import RingStrategy

    from ..frameworks.lightning_job import BATCH, MLP

    class Driver(L.Callback):
        def on_train_batch_start(self, trainer, _module, _batch, index: int) -> None:
            schedule.before(index)

        def on_train_batch_end(self, trainer, _module, _outputs, _batch, index: int) -> None:
            schedule.after(index)

    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy=RingStrategy(bucket_bytes=bucket_bytes),
        accelerator="cpu",
        devices=1,
        max_steps=schedule.total,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[Driver()],
    )
    rows = BATCH * ringplug.size() * schedule.total
    data = TensorDataset(torch.randn(rows, 1024), torch.randint(0, 10, (rows,)))
    trainer.fit(MLP(hidden), DataLoader(data, batch_size=BATCH))


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ringplug.init()
    schedule = Schedule(args)
    step_driver: Callable[[], None]
    if args.workload == "fusion":
        step_driver = lambda: _fusion_steps(schedule)  # noqa: E731
    else:
        step_driver = lambda: _lightning_steps(schedule, args.hidden, args.bucket_bytes)  # noqa: E731
    step_driver()
    times = schedule.slowest()
    tuner = schedule.tuner
    assert tuner is not None and tuner.search is not None and schedule.tuned is not None
    if ringplug.rank() != 0:
        return 0
    medians = {label: statistics.median(values) for label, values in times.items()}
    swept = {_label(c): medians[_label(c)] for c in SWEEP}
    best_label = min(swept, key=swept.__getitem__)
    ratio = medians[best_label] / medians[TUNED]  # throughput: tuned / best
    # The same, round by round (each round runs every setting within seconds): less
    # exposed to the machine's load drifting between rounds.
    per_round = [
        statistics.median(times[best_label][i : i + args.iters])
        / statistics.median(times[TUNED][i : i + args.iters])
        for i in range(0, len(times[TUNED]), args.iters)
    ]
    round_ratio = statistics.median(per_round)
    print(
        f"# ringplug-bench autotune --workload {args.workload}: {ringplug.size()} ranks; "
        f"step time = median of the slowest rank over {args.rounds} rounds x {args.iters} "
        "steps, settings interleaved"
    )
    print(f"# {'setting':<16} {'step ms':>9} {'vs best':>8}")
    for label in [_label(BAD), *swept, TUNED]:
        shown = f"{label} = {_label(schedule.tuned)}" if label == TUNED else label
        print(
            f"  {shown:<16} {medians[label] * 1e3:9.2f} {medians[best_label] / medians[label]:8.2f}"
        )
    print(
        f"# autotuned ({_label(schedule.tuned)}) / best of sweep ({best_label}) throughput = "
        f"{ratio:.2f} (target >= 0.9), median of the rounds' ratios {round_ratio:.2f}; "
        f"against the default (64M/0ms) {medians[_label(SWEEP[3])] / medians[TUNED]:.2f}; "
        f"tuning used {tuner.steps} steps (target <= 50), "
        f"{len(tuner.search.order)} samples, "
        f"{'converged' if tuner.search.converged else 'ran out of samples'}; "
        f"tuning took {schedule.tuning_seconds:.2f} s"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {
                    "workload": args.workload,
                    "ranks": ringplug.size(),
                    "median_step_s": medians,
                    "best_of_sweep": best_label,
                    "tuned": _label(schedule.tuned),
                    "throughput_ratio": ratio,
                    "round_ratios": per_round,
                    "tuning_steps": tuner.steps,
                    "samples": len(tuner.search.order),
                    "converged": tuner.search.converged,
                    "trials": [(_label(c), score) for c, score in tuner.search.history],
                },
                handle,
                indent=1,
            )
        print(f"# wrote {args.json}")
    return 0
