"""Why a data-parallel fit is slow: each rank's step time split into phases, and a verdict.

Framework adapters (``ringplug.lightning``, ``ringplug.keras``, ``ringplug.torch``) tell the
rank's `StepClock` when a step's phases begin and end; nothing here knows a framework.
Per rank and per step the clock keeps:

- **data**: time spent fetching this rank's next batch (its own loader; waiting for the
  other ranks is not counted here);
- **compute**: forward and backward, from the batch reaching the step to the end of
  backward;
- **communication**: exposed gradient reduction, the wait after backward for reductions
  that backward did not hide;
- **optimizer**: the update after the gradients are averaged;
- **other**: the rest of the step (the framework's own per-step work, waiting for other
  ranks outside the reduction);
- the collectives the engine ran during the step, and how many gradient allreduces the
  optimizer started (for the latency-bound verdict: round trips, not bytes).

At the end of fit (and every N steps when asked) every rank sends its medians to every
other (one collective), rank 0 prints a table and one verdict line, and the adapter hands
the numbers to the framework's logger. With a timeline recording, rank 0 also writes each
rank's steps onto per-rank tracks.

Example (the torch loop; Lightning and Keras do this for you):
    >>> clock = ringplug.diagnose.StepClock()  # doctest: +SKIP
    >>> clock.start()
    >>> for batch in clock.batches(loader):
    ...     loss_fn(model(batch)).backward(); optimizer.step(); optimizer.zero_grad()
    >>> clock.finish()  # the table and the verdict, on rank 0
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from .core import activity

PHASES = ("data", "compute", "communication", "optimizer", "other")

# Verdict thresholds, as shares of the median step. A phase has to take a quarter of the
# step before it is named: below that, fixing it buys less than a quarter.
DATA_SHARE = 0.25
COMMUNICATION_SHARE = 0.25
# A straggler computes this much slower than the others' median, and the difference is at
# least this share of the step (so a few microseconds on a tiny model are not a verdict).
STRAGGLER_RATIO = 1.3
STRAGGLER_SHARE = 0.10
# Whether a reduction's wait is about its bytes (see `bandwidth_matters`). A small allreduce
# costs at least a round trip: 46-52 us for 4 KiB on 2 ranks of the 2-core CI machine (see
# `ringplug.config`); across hosts it costs more, so taking the least keeps bandwidth in the
# verdict for as many bytes as possible. Without a ceiling measured by `ringrun --check
# --bench`, the link is taken to be a slow one, 1 Gb/s Ethernet (about 0.1 GB/s of bus
# bandwidth): bytes a link that slow moves in a small share of the wait move as fast on any.
# With both, bandwidth is not named below 5 KB per allreduce of 2 ranks (at a measured 6 GB/s:
# 300 KB), nor when the bytes would take under BANDWIDTH_SHARE of the measured wait.
ROUND_TRIP = 50e-6
SLOW_ROUND_TRIP = 1e-3  # 20 round trips: not the link, but ranks kept from running
ASSUMED_BUSBW = 0.1e9
BANDWIDTH_SHARE = 0.25
_KEEP_STEPS = 10_000  # rows kept per rank for the final medians (a ring buffer)
_TRACE_STEPS = 2_000  # steps per report that go to the timeline

_active: StepClock | None = None


def active() -> StepClock | None:
    """The clock of the fit running in this process, or None (adapters check this first)."""
    return _active


def arrived() -> None:
    """The batch reached the training step: tell the active clock, or just the activity."""
    clock = _active
    if clock is not None:
        clock.arrived()
    else:
        activity.set_phase(activity.COMPUTING)


@dataclasses.dataclass
class RankSummary:
    """One rank's medians over the steps of a report, in seconds."""

    rank: int
    host: str
    steps: int
    step: float
    data: float
    compute: float
    communication: float
    optimizer: float
    other: float
    bytes_per_step: float  # gradient bytes this rank reduced per step
    window: float  # median time from the first reduction's start to the last one's end
    own_time: float  # the step less its reduction wait: when this rank reaches the reduction
    collectives: float  # collectives the engine ran per step, all of them (0: not known)
    reductions: float  # gradient allreduces per step (DistributedOptimizer: its buckets)

    def share(self, phase: str) -> float:
        """`phase`'s median as a share of the median step (0 when steps took no time)."""
        return getattr(self, phase) / self.step if self.step > 0 else 0.0


@dataclasses.dataclass
class Verdict:
    """The bottleneck: ``kind`` is data-bound, communication-bound, latency-bound,
    straggler, late rank or compute-bound (``no steps`` when nothing was measured);
    ``rank`` the rank named."""

    kind: str
    rank: int | None
    text: str


@dataclasses.dataclass
class Diagnosis:
    """Every rank's medians and the verdict, the same on every rank."""

    ranks: list[RankSummary]
    verdict: Verdict
    ceiling_busbw: float | None  # bytes/s that `ringrun --check --bench` measured, if known
    final: bool

    @property
    def busbw(self) -> float | None:
        """Bus bandwidth the gradient reductions reached (bytes/s), over the reduction
        window (from the first bucket's start to the last one's end)."""
        return achieved_busbw(self.ranks)

    def table(self) -> str:
        """The table rank 0 prints: medians per rank in milliseconds, and the verdict."""
        steps = min((r.steps for r in self.ranks), default=0)
        width = max([4, *(len(r.host) for r in self.ranks)])
        lines = [
            f"ringplug step-time breakdown ({'end of fit' if self.final else 'so far'}, "
            f"medians over {steps} steps, ms)",
            f"{'rank':>4}  {'host':<{width}}  {'step':>7}  {'data':>7}  {'compute':>7}  "
            f"{'comm':>7}  {'optim':>7}  {'other':>7}  {'MiB/step':>8}",
        ]
        for r in self.ranks:
            cells = "  ".join(f"{getattr(r, p) * 1e3:7.2f}" for p in ("step", *PHASES))
            lines.append(
                f"{r.rank:>4}  {r.host:<{width}}  {cells}  {r.bytes_per_step / 2**20:8.2f}"
            )
        lines.append(f"verdict: {self.verdict.text}")
        return "\n".join(lines)

    def metrics(self, separator: str = "/") -> dict[str, float]:
        """Flat numbers for a logger: ``ringplug/rank1/data_ms``, ``.../data_share``, and
        ``ringplug/bus_gbps``; `separator` joins the parts (Keras logs use ``_``)."""
        out: dict[str, float] = {}
        for r in self.ranks:
            base = f"ringplug{separator}rank{r.rank}{separator}"
            out[f"{base}step_ms"] = r.step * 1e3
            for phase in PHASES:
                out[f"{base}{phase}_ms"] = getattr(r, phase) * 1e3
                out[f"{base}{phase}_share"] = r.share(phase)
        busbw = self.busbw
        if busbw is not None:
            out[f"ringplug{separator}bus_gbps"] = busbw / 1e9
        return out

    def as_dict(self) -> dict[str, Any]:
        """Everything, as plain data (for JSON)."""
        return {
            "ranks": [dataclasses.asdict(r) for r in self.ranks],
            "verdict": dataclasses.asdict(self.verdict),
            "busbw": self.busbw,
            "ceiling_busbw": self.ceiling_busbw,
            "final": self.final,
        }


class _Step:
    """The timestamps of the step in progress (time.perf_counter seconds; 0: not yet)."""

    __slots__ = (
        "data",
        "data_start",
        "arrived",
        "backward_end",
        "reduce_start",
        "reduced",
        "nbytes",
        "reductions",
    )

    def __init__(self) -> None:
        self.data = 0.0
        self.data_start = 0.0
        self.arrived = 0.0
        self.backward_end = 0.0
        self.reduce_start = 0.0
        self.reduced = 0.0
        self.nbytes = 0
        self.reductions = 0  # gradient allreduces started (DistributedOptimizer: buckets)


class StepClock:
    """Records one rank's training steps, phase by phase, and reports over every rank.

    Every rank makes one, starts it before its first batch and finishes it after its last
    (all ranks must run the same number of steps: reports are collectives).

    Args:
        every_n_steps: also report every this many steps. Defaults to ``None`` (only at
            `finish`).
        on_report: called on every rank with each `Diagnosis` (adapters log it). Defaults
            to ``None``.
        trace: write the steps onto the timeline's per-rank tracks (when rank 0 records a
            timeline). Defaults to True.
        print_table: rank 0 prints the table at each report. Defaults to True.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        on_report: Callable[[Diagnosis], None] | None = None,
        trace: bool = True,
        print_table: bool = True,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(
                f"every_n_steps must be a positive number of steps, not {every_n_steps}."
            )
        self.every_n_steps = every_n_steps
        self.on_report = on_report
        self.trace = trace
        self.print_table = print_table
        self.diagnosis: Diagnosis | None = None  # the last report
        # (start, data_start, data, arrived, backward_end, reduce_start, reduced, end, nbytes,
        #  collectives, reductions): see `summarize`
        self._rows: collections.deque[tuple] = collections.deque(maxlen=_KEEP_STEPS)
        self._since_report = 0
        self._step = _Step()
        self._last_end = time.perf_counter()
        self._engine: Any = None  # counts the collectives it runs (read, never waited on)
        self._last_ran = 0  # the engine's count when the previous step ended
        self._reports = 0
        self.steps = 0  # steps measured so far
        self.fetch_began = 0.0  # see fetched()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin measuring (before the first batch is fetched); makes this the active clock."""
        global _active
        from .core import runtime

        _active = self
        self._engine = runtime.current_engine()
        self._last_ran = self._ran()
        self._step = _Step()
        self._last_end = time.perf_counter()
        activity.set_phase(activity.WAITING_FOR_DATA)

    def finish(self) -> Diagnosis:
        """Stop measuring and report over every rank (a collective: every rank calls it)."""
        global _active
        if _active is self:
            _active = None
        activity.set_phase(activity.BETWEEN_STEPS)
        return self.report(list(self._rows), final=True)

    def _ran(self) -> int:
        """How many collectives this process's engine has run (0 without an engine)."""
        return getattr(self._engine, "collectives_run", 0)

    # ------------------------------------------------------------------ phases
    def data(self, start: float, end: float) -> None:
        """This rank fetched a batch from `start` to `end` (perf_counter seconds)."""
        step = self._step
        if not step.data_start:
            step.data_start = start
        step.data += end - start

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """`iterable`'s items, each fetch timed as data (for a hand-written loop)."""
        iterator = iter(iterable)
        while True:
            activity.set_phase(activity.WAITING_FOR_DATA)
            start = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                activity.set_phase(activity.OUT_OF_DATA)
                return
            now = time.perf_counter()
            self.data(start, now)
            self.arrived(now)
            yield item

    def fetched(self, now: float | None = None) -> None:
        """The batch reached the step after a fetch that began at `fetch_began` (set by the
        adapter; else when the previous step ended): for frameworks that fetch inside
        their own step function, as Keras does."""
        now = time.perf_counter() if now is None else now
        if not self._step.arrived:
            self.data(max(self.fetch_began, self._last_end), now)
        self.arrived(now)

    def arrived(self, now: float | None = None) -> None:
        """The batch reached the training step: compute begins (the first call of a step
        counts, so accumulation micro-batches add up)."""
        if not self._step.arrived:
            self._step.arrived = time.perf_counter() if now is None else now
        activity.set_phase(activity.COMPUTING)

    def reduction_started(self, now: float) -> None:
        """A gradient reduction was started (the first one of a step opens the window)."""
        step = self._step
        step.reductions += 1
        if not step.reduce_start:
            step.reduce_start = now

    def backward_ended(self, now: float) -> None:
        """Backward is done and the wait for its reductions begins (exposed communication)."""
        step = self._step
        step.backward_end = now
        if not step.reduce_start:
            step.reduce_start = now
        activity.set_phase(activity.REDUCING)

    def reduced(self, now: float, nbytes: int) -> None:
        """The step's gradients (`nbytes` of them) are averaged; the optimizer step begins."""
        self._step.reduced = now
        self._step.nbytes += nbytes
        activity.set_phase(activity.STEPPING)

    def step_ended(self, now: float | None = None) -> None:
        """The optimizer step is done: the step's row is closed (and maybe reported)."""
        end = time.perf_counter() if now is None else now
        s = self._step
        ran = self._ran()
        if s.arrived:  # a step() with no batch (a dry run) is not a training step
            self._rows.append(
                (
                    self._last_end,
                    s.data_start,
                    s.data,
                    s.arrived,
                    s.backward_end,
                    s.reduce_start,
                    s.reduced,
                    end,
                    s.nbytes,
                    ran - self._last_ran,
                    # A caller that reports only the reduction's end (Keras) made one.
                    s.reductions or (1 if s.reduced else 0),
                )
            )
            self._since_report += 1
            self.steps += 1
        self._step = _Step()
        self._last_end = end
        self._last_ran = ran
        activity.set_phase(activity.WAITING_FOR_DATA)
        if self.every_n_steps and self._since_report >= self.every_n_steps:
            self.report(self.recent(self._since_report), final=False)

    # ------------------------------------------------------------------ reports
    def recent(self, count: int) -> list[tuple]:
        """The rows of the last `count` steps (for a report over them)."""
        return list(self._rows)[-count:] if count > 0 else []

    def report(self, rows: list[tuple], final: bool, show: bool = True) -> Diagnosis:
        """Gather every rank's medians over `rows` (a collective) and build the verdict;
        rank 0 prints the table when `show` (and the clock's ``print_table``)."""
        from . import core

        self._since_report = 0
        self._reports += 1
        summary = summarize(rows, core.rank(), socket.gethostname())
        spans = None
        if self.trace:
            # Wall clock minus this process's perf_counter, so rank 0 can line ranks up.
            spans = (time.time() - time.perf_counter(), rows[-_TRACE_STEPS:])
        everyone = core.allgather_object(
            (summary, spans), name=f"ringplug.diagnose.{self._reports}"
        )
        ranks = [s for s, _ in everyone]
        ceiling = read_ceiling(len(ranks), sorted({r.host for r in ranks}))
        diagnosis = Diagnosis(ranks, verdict(ranks, ceiling), ceiling, final)
        self.diagnosis = diagnosis
        if core.rank() == 0:
            _trace(everyone)
            if self.print_table and show:
                print(diagnosis.table(), file=sys.stdout, flush=True)
        if self.on_report is not None:
            self.on_report(diagnosis)
        self._last_ran = self._ran()  # the report's own collectives are no step's
        return diagnosis


def summarize(rows: list[tuple], rank: int, host: str) -> RankSummary:
    """One rank's medians over its step rows (`StepClock`'s tuples)."""
    # The first step pays for warm-up (allocations, lazy initialisation): leave it out
    # when there are others.
    rows = rows[1:] if len(rows) > 1 else rows
    names = ("step", *PHASES, "bytes", "window", "own", "collectives", "reductions")
    columns: dict[str, list[float]] = {name: [] for name in names}
    for row in rows:
        start, _, data, arrived, backward_end, reduce_start, reduced, end, nbytes = row[:9]
        collectives, reductions = row[9:]
        step = end - start
        backward_end = backward_end or end
        reduced = reduced or backward_end
        compute = max(backward_end - arrived, 0.0)
        communication = max(reduced - backward_end, 0.0)
        optimizer = max(end - reduced, 0.0)
        columns["step"].append(step)
        columns["data"].append(data)
        columns["compute"].append(compute)
        columns["communication"].append(communication)
        columns["optimizer"].append(optimizer)
        columns["other"].append(max(step - data - compute - communication - optimizer, 0.0))
        columns["bytes"].append(float(nbytes))
        columns["window"].append(max(reduced - reduce_start, 0.0) if nbytes else 0.0)
        columns["own"].append(step - communication)
        columns["collectives"].append(float(collectives))
        columns["reductions"].append(float(reductions))

    def median(name: str) -> float:
        values = columns[name]
        return statistics.median(values) if values else 0.0

    return RankSummary(
        rank,
        host,
        len(rows),
        median("step"),
        median("data"),
        median("compute"),
        median("communication"),
        median("optimizer"),
        median("other"),
        median("bytes"),
        median("window"),
        median("own"),
        median("collectives"),
        median("reductions"),
    )


def achieved_busbw(ranks: list[RankSummary]) -> float | None:
    """Bus bandwidth of the gradient reductions (bytes/s, as nccl-tests count it: an
    allreduce of S bytes on n ranks moves 2(n-1)/n S per rank), or None with none."""
    n = len(ranks)
    windows = [r.window for r in ranks if r.window > 0 and r.bytes_per_step > 0]
    if n < 2 or not windows:
        return None
    nbytes = statistics.median(r.bytes_per_step for r in ranks)
    return 2 * (n - 1) / n * nbytes / statistics.median(windows)


def verdict(ranks: list[RankSummary], ceiling_busbw: float | None = None) -> Verdict:
    """Name the bottleneck from every rank's medians.

    In order: a rank whose own data loading takes at least `DATA_SHARE` of the step is
    data-bound (the others wait for it, wherever that shows); then, when every rank waits
    at least `COMMUNICATION_SHARE` of its step for the reduction after backward (behind a
    straggler or a slow loader only the others wait), the job is communication-bound if
    its bytes can explain the wait (`bandwidth_matters`), else latency-bound; then a rank
    computing at least `STRAGGLER_RATIO` times the others' median (and `STRAGGLER_SHARE`
    of the step more) is a straggler; then a rank whose own work per step (all but its
    reduction wait) makes the others wait at least `STRAGGLER_SHARE` of the step longer
    than it does is a late rank, named even when its compute alone is no straggler's;
    otherwise compute-bound. A late rank that costs the others more than the reduction
    costs every rank is named before the reduction is.
    """
    if not ranks or all(r.steps == 0 for r in ranks):
        return Verdict("no steps", None, "no training steps were measured.")
    step = statistics.median(r.step for r in ranks)
    loader = max(ranks, key=lambda r: r.share("data"))
    if loader.share("data") >= DATA_SHARE:
        others = [r.rank for r in ranks if r is not loader and r.share("data") >= DATA_SHARE]
        also = f" (so do {_rank_list(others)})" if others else ""
        return Verdict(
            "data-bound",
            loader.rank,
            (
                f"data-bound: rank {loader.rank} waits {loader.share('data'):.0%} of each step for "
                f"data ({loader.data * 1e3:.1f} of {loader.step * 1e3:.1f} ms){also}, and every "
                "rank waits for the slowest: give its loader more workers (DataLoader "
                "num_workers, persistent_workers=True, pin_memory on GPUs; tf.data "
                "prefetch/AUTOTUNE), or make loading cheaper (decode once, cache)."
            ),
        )
    late, lateness = _late_rank(ranks, step)
    # Every rank waits for a slow network or for round trips; behind a straggler or a late
    # rank only the others do. What the last rank to arrive waits is the reduction's own.
    exposed = min(r.share("communication") for r in ranks)
    wait = min(r.communication for r in ranks)
    if exposed >= COMMUNICATION_SHARE and lateness <= wait:
        if bandwidth_matters(ranks, wait, ceiling_busbw):
            return _communication_bound(ranks, exposed, ceiling_busbw)
        return _latency_bound(ranks, exposed, wait, ceiling_busbw)
    if len(ranks) >= 2:
        slowest = max(ranks, key=lambda r: r.compute)
        typical = statistics.median(r.compute for r in ranks if r is not slowest)
        if (
            slowest.compute >= STRAGGLER_RATIO * typical
            and slowest.compute - typical >= STRAGGLER_SHARE * step
        ):
            ratio = slowest.compute / typical if typical > 0 else math.inf
            slower = f"{ratio - 1:.0%} slower than" if ratio < 2 else f"{ratio:.1f}x as long as"
            return Verdict(
                "straggler",
                slowest.rank,
                (
                    f"straggler: rank {slowest.rank} computes {slower} the median of the others "
                    f"({slowest.compute * 1e3:.1f} against {typical * 1e3:.1f} ms "
                    "per step) and every rank waits for it: look at what differs there (a busier "
                    "host or GPU, throttling, larger batches, extra work such as logging or "
                    "checkpointing only on that rank)."
                ),
            )
    if late is not None:
        return _late_verdict(ranks, late, step)
    busy = statistics.median(r.share("compute") + r.share("optimizer") for r in ranks)
    waiting = statistics.median(r.share("communication") for r in ranks)
    return Verdict(
        "compute-bound",
        None,
        (
            f"compute-bound: ranks spend {busy:.0%} of each step in forward, backward and the "
            f"optimizer, and {waiting:.0%} waiting for gradients: nothing to fix in distribution."
        ),
    )


def link_busbw(ceiling_busbw: float | None) -> float:
    """The bus bandwidth (bytes/s) the verdict takes the link to reach: the measured
    ceiling, or `ASSUMED_BUSBW` without one."""
    return ceiling_busbw if ceiling_busbw else ASSUMED_BUSBW


def moving_time(ranks: list[RankSummary], ceiling_busbw: float | None = None) -> float:
    """Seconds the link (`link_busbw`) needs for a step's gradient bytes: an allreduce of S
    bytes on n ranks moves 2(n-1)/n S per rank over the bus."""
    n = len(ranks)
    nbytes = statistics.median(r.bytes_per_step for r in ranks)
    return 2 * (n - 1) / n * nbytes / link_busbw(ceiling_busbw) if n > 1 else 0.0


def bandwidth_matters(
    ranks: list[RankSummary], wait: float, ceiling_busbw: float | None = None
) -> bool:
    """Whether the gradient bytes can explain a reduction `wait` (seconds) of every rank.

    The model of one step's reduction: each of its allreduces pays a round trip
    (`ROUND_TRIP`), and its bytes cross the link at the link's bus bandwidth
    (`moving_time`): ``allreduces * ROUND_TRIP + 2(n-1)/n * bytes / busbw``. The bytes
    matter when their term is at least the round trips' (each allreduce is past its
    half-bandwidth point: a link going slower than it should, as under contention, still
    shows in bytes), or at least `BANDWIDTH_SHARE` of the measured wait. Below both,
    fewer bytes or a faster link buy back little: the wait is round trips or ranks
    waiting for each other.
    """
    allreduces = max(statistics.median(r.reductions for r in ranks), 1.0)
    moving = moving_time(ranks, ceiling_busbw)
    return moving >= allreduces * ROUND_TRIP or moving >= BANDWIDTH_SHARE * wait


def _communication_bound(
    ranks: list[RankSummary], exposed: float, ceiling_busbw: float | None
) -> Verdict:
    nbytes = statistics.median(r.bytes_per_step for r in ranks)
    busbw = achieved_busbw(ranks)
    reached = f", {busbw / 1e9:.2f} GB/s bus bandwidth" if busbw else ""
    if ceiling_busbw:
        against = f" against {ceiling_busbw / 1e9:.2f} GB/s by ringrun --check --bench"
        if busbw and busbw < 0.5 * ceiling_busbw:
            against += " (the link can do more: look for contention, waits or the wrong interface)"
    else:
        against = " (ringrun --check --bench -np N measures what the link reaches)"
    return Verdict(
        "communication-bound",
        None,
        (
            f"communication-bound: every rank waits {exposed:.0%} or more of each step for the "
            f"gradient reduction after backward ({nbytes / 2**20:.1f} MiB per step{reached}"
            f"{against}): larger batches per rank, gradient accumulation "
            "(backward_passes_per_step), compression='fp16', or a faster interconnect."
        ),
    )


def _latency_bound(
    ranks: list[RankSummary], exposed: float, wait: float, ceiling_busbw: float | None
) -> Verdict:
    nbytes = statistics.median(r.bytes_per_step for r in ranks)
    busbw = link_busbw(ceiling_busbw)
    moving = moving_time(ranks, ceiling_busbw)
    if ceiling_busbw:
        link = f"{busbw / 1e9:.2f} GB/s, what ringrun --check --bench measured"
    else:
        link = f"{busbw / 1e9:.2f} GB/s, a slow link; ringrun --check --bench -np N measures yours"
    allreduces = statistics.median(r.reductions for r in ranks)
    collectives = statistics.median(r.collectives for r in ranks)
    counted = ""
    if allreduces >= 1:
        each = wait / allreduces
        counted = (
            f" ({_count(allreduces, 'gradient allreduce')} per step, "
            f"{each * 1e3:.2f} ms{' each' if allreduces != 1 else ''}"
        )
        if collectives > allreduces:
            counted += f"; {collectives:g} collectives per step in all"
        if each >= SLOW_ROUND_TRIP:
            counted += (
                f"; an idle host's round trip takes about {ROUND_TRIP * 1e3:.2f} ms, so these "
                "ranks also wait for a CPU or for one another, as with more processes than cores"
            )
        counted += ")"
    advice = []
    if allreduces != 1:  # several (or not known): fusing them saves round trips
        advice.append(
            "fuse the gradients into fewer allreduces (a larger bucket_bytes, "
            "RINGPLUG_FUSION_THRESHOLD, RINGPLUG_CYCLE_TIME)"
        )
    advice.append(
        "reduce less often (gradient accumulation: backward_passes_per_step or "
        "accumulate_grad_batches; larger batches per rank)"
    )
    if collectives == 0 or collectives > max(allreduces, 1):
        advice.append(
            "every metric logged with sync_dist=True adds a collective per step: log fewer, "
            "or less often"
        )
    return Verdict(
        "latency-bound",
        None,
        (
            f"latency-bound: every rank waits {exposed:.0%} or more of each step for the "
            f"gradient reduction after backward, but it moves only {_size(nbytes)} per step "
            f"({_duration(moving)} of the {wait * 1e3:.2f} ms wait at {link}): the wait is "
            f"round trips, not bandwidth{counted}: {'; '.join(advice)}."
        ),
    )


def _late_rank(ranks: list[RankSummary], step: float) -> tuple[RankSummary | None, float]:
    """The rank that reaches the reduction last and by how much (seconds), if that is at
    least `STRAGGLER_SHARE` of the step; else (None, 0)."""
    if len(ranks) < 2:
        return None, 0.0
    at = max(range(len(ranks)), key=lambda i: ranks[i].own_time)
    late, others = ranks[at], ranks[:at] + ranks[at + 1 :]
    # Two views of one lateness (medians, so they differ), the lesser counts: its own work
    # takes longer than theirs, and they wait longer than it does.
    behind = late.own_time - statistics.median(r.own_time for r in others)
    waited = statistics.median(r.communication for r in others) - late.communication
    lateness = min(behind, waited)
    return (late, lateness) if lateness >= STRAGGLER_SHARE * step else (None, 0.0)


_LATE_PHASE = {
    "data": "loading its data",
    "compute": "forward and backward",
    "optimizer": "the optimizer update",
    "other": "the rest of the step",
}
_LATE_ADVICE = {
    "data": (
        "its loader is slower, though not yet data-bound: give it more workers (num_workers) "
        "or look at its storage"
    ),
    "compute": (
        "its forward and backward are slower: look at what differs there (a busier host or "
        "GPU, throttling, larger batches)"
    ),
    "optimizer": (
        "its optimizer update is slower: look at what differs there (a busier host or GPU, "
        "extra work in its update)"
    ),
    "other": (
        "it does more per-step work outside forward, backward and the update: look for work "
        "only that rank does (logging, callbacks, checkpoints, validation, a progress bar) "
        "or a busier host"
    ),
}


def _late_verdict(ranks: list[RankSummary], late: RankSummary, step: float) -> Verdict:
    others = [r for r in ranks if r.rank != late.rank]
    typical = statistics.median(r.own_time for r in others)
    waited = statistics.median(r.communication for r in others) - late.communication
    phases = ("data", "compute", "optimizer", "other")
    usual = {p: statistics.median(getattr(r, p) for r in others) for p in phases}
    phase = max(phases, key=lambda p: getattr(late, p) - usual[p])
    return Verdict(
        "late rank",
        late.rank,
        (
            f"late rank: rank {late.rank} reaches the gradient reduction last, "
            f"{(late.own_time - typical) * 1e3:.1f} ms after the others (its own work per "
            f"step takes {late.own_time * 1e3:.1f} against {typical * 1e3:.1f} ms, most of "
            f"the difference in {_LATE_PHASE[phase]}: {getattr(late, phase) * 1e3:.1f} against "
            f"{usual[phase] * 1e3:.1f} ms), so {_rank_list([r.rank for r in others])} "
            f"{'waits' if len(others) == 1 else 'wait'} {waited * 1e3:.1f} ms longer than it "
            f"does ({waited / step:.0%} of each step): {_LATE_ADVICE[phase]}."
        ),
    )


def _count(value: float, noun: str) -> str:
    return f"{value:g} {noun}{'' if value == 1 else 's'}"


def _size(nbytes: float) -> str:
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes >= 2**10 else f"{nbytes:.0f} B"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _trace(everyone: list[tuple[RankSummary, Any]]) -> None:
    """Rank 0: every rank's steps onto the timeline's per-rank tracks, if one records."""
    from .core import runtime

    engine = runtime.engine() if runtime.is_initialized() else None
    timeline = getattr(engine, "timeline", None)
    if timeline is None or everyone[0][1] is None:
        return
    own_offset = everyone[0][1][0]
    for rank, (_, spans) in enumerate(everyone):
        if spans is None:
            continue
        offset, rows = spans
        shift = offset - own_offset  # rank's perf_counter -> rank 0's, through wall clocks
        for _, data_start, data, arrived, backward_end, _, reduced, end, *_ in rows:
            backward_end = backward_end or end
            reduced = reduced or backward_end
            if data:
                timeline.track(rank, "data", data_start + shift, data_start + data + shift)
            timeline.track(rank, "compute", arrived + shift, backward_end + shift)
            if reduced > backward_end:
                timeline.track(rank, "communication", backward_end + shift, reduced + shift)
            timeline.track(rank, "optimizer", reduced + shift, end + shift)
    timeline.flush()


# ---------------------------------------------------------------------- measured ceiling
def ceiling_path() -> Path:
    """Where `ringrun --check --bench` keeps what it measured (the user's cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ringplug" / "ceiling.json"


def read_ceiling(ranks: int, hosts: list[str]) -> float | None:
    """The peak bus bandwidth measured for this many ranks on these hosts, or None."""
    try:
        entries = json.loads(ceiling_path().read_text())
    except (OSError, ValueError):
        return None
    for entry in entries if isinstance(entries, list) else []:
        if entry.get("ranks") == ranks and sorted(entry.get("hosts", [])) == hosts:
            return float(entry["busbw"])
    return None


def write_ceiling(ranks: int, hosts: list[str], busbw: float, **extra: Any) -> Path:
    """Remember a measured peak bus bandwidth for (ranks, hosts), replacing an older one."""
    path = ceiling_path()
    try:
        entries = json.loads(path.read_text())
        entries = entries if isinstance(entries, list) else []
    except (OSError, ValueError):
        entries = []
    hosts = sorted(hosts)
    entries = [e for e in entries if not (e.get("ranks") == ranks and e.get("hosts") == hosts)]
    measured = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    entries.append({"ranks": ranks, "hosts": hosts, "busbw": busbw, "measured": measured, **extra})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=1) + "\n")
    return path
