"""Autotune: tunes the engine's fusion threshold, cycle time and the allreduce's algorithm
crossovers while the job trains.

With ``RINGPLUG_AUTOTUNE=1`` (``ringrun --autotune``) the world's engine hands every cycle's
plan to an :class:`Autotuner` (`Cycle.run_plan` calls :meth:`Autotuner.after_cycle`). The
plans are the same on every rank, so everything the tuner counts from them is too: the
steps (a step ends at the cycle where a collective's name comes again), the bytes reduced,
where a sample of ``RINGPLUG_AUTOTUNE_STEPS_PER_SAMPLE`` steps ends. Only the clock differs
between ranks: at the end of a sample rank 0's score (bytes reduced per second over the
sample's steps, its first step after the change left out: their bytes over their time) is
broadcast through the engine's transport, and every rank feeds that same score into the
same deterministic :class:`Search`. So every rank applies the same setting at the end of the
same cycle, with no decision to send.

The search is a model-guided local search on a small grid, not Horovod's Gaussian process:

1. warm-up samples at the starting setting measure the bytes of each cycle of a step;
2. the starting setting is scored;
3. an alpha-beta :class:`CostModel` of a step's collectives (a latency per fused
   collective, the cycle time once per cycle; the bandwidth term is the same for every
   setting) names its best setting: a fusion threshold just above the largest cycle's bytes
   (larger ones fuse nothing more, so the grid is cut there) and no cycle time; it is
   scored next, then every other smaller threshold (a coarse spread, stopped where the
   score falls: the model leaves out what a buffer larger than the cache costs). The
   spread's best is then scored a second time (it keeps the mean of its two scores, and
   gives way to any setting that beats that), so that one lucky score does not decide
   where the local search looks;
4. from the best so far, the untried grid neighbours (one grid step in one of the two
   settings) are scored one per sample, every one without cycle time first, then
   cheapest by the model. A neighbour that beats the best by ``margin`` (3%: the noise of
   a shared machine does not walk the search around) is scored again at once, and takes
   over only if both its scores beat the best (one outlying score, on a quiet moment of
   the machine, cannot make it the best: a 2-rank fusion run once followed such a score to
   64 MiB, 0.74 of the best's throughput); it keeps the mean of the two. One with a cycle
   time must beat one without by :data:`CYCLE_MARGIN` (10%). The model does not price what
   a cycle time costs beyond its wait: any cycle time above 0 switches off the engine's
   caller-run cycles and its gathering of a burst of submissions into one cycle, which
   costs from nothing to a third of a step. So cycle times are tried only once the best
   threshold without one is found (its threshold neighbours without one come first even
   while the start, with its cycle time, is the best), and kept only on a clear win;
5. once no neighbour of the best is left untried, the algorithm table's crossovers around
   the sizes the step actually reduces: the step's fused allreduce buffers at the best
   threshold (the engine's own batching of the plans measured at the start) are grouped
   by the band of the table's allreduce row they fall in, and for each group, the one the
   table's choice takes most time on first (:meth:`Search.band_trials`), the other
   algorithms of the row (``mpi``, ``doubling``, ``ring``, and ``hierarchical`` where the
   ranks span hosts: `core.algorithms`) are tried on that group's range of sizes only (a
   `core.algorithms.Band`, such as ``ring@[64K,128K)``: from the power of 2 at or below
   its smallest buffer to the one above its largest, within the table's band), every
   other size keeping the table's choice: so a crossover moves, or a band appears around
   the buffers, and nothing changes where the job has no buffer. The table's models,
   read from their measured points as its bands are (`Model.cost`), order them and leave
   out those they price at :data:`MODEL_SKIP` times the table's choice or more. A winner
   is scored again as in 4, and the next group's trials keep it. None are tried where
   ``RINGPLUG_ALGORITHM`` forces the allreduce, or once a GPU collective ran;
6. when nothing is left to try (converged), or only room for this is left of the budget,
   the best (or a challenger there was no room to score again), the start and a runner-up
   (the best it challenged; else the best setting with the table's crossovers and without
   cycle time if the best has bands or a cycle time; else the highest other without one
   within 15%) are scored once more, back to back (:meth:`Search.contenders`). Of the best
   and the runner-up the higher second score wins (the best's first score, the highest of
   several noisy ones, is too high), a cycle time only by 10%, and within the margin the
   one the model finds cheaper (the table's crossovers before bands); and the
   winner is kept only if its second score beats the start's second score, else the
   start is kept (tuning never leaves a job slower than it started, as far as the scores
   can tell);
7. then, or after ``RINGPLUG_AUTOTUNE_MAX_SAMPLES`` samples, the best is applied and
   tuning stops.

With the defaults that is at most (1 + 15) x 3 = 48 training steps. Results do not depend
on the setting beyond floating-point reassociation: the fusion threshold changes which
tensors are summed in one buffer, never what is summed, the cycle time only when a cycle
starts, and the algorithm only the order in which the ranks' values are added.
"""

from __future__ import annotations

import bisect
import csv
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol

import numpy as np

from ..config import Settings
from ..wire import Kind, Response
from .algorithms import ALLREDUCE, SERIES, AlgorithmTable, Band
from .dtypes import ITEMSIZE
from .engine.batches import batches


class Tunable(Protocol):
    """What the tuner needs of an engine (`Engine` has it; no import of the engine here,
    which imports this module)."""

    settings: Settings
    rank: int
    waiter: Any  # transport.waiting.Waiter
    transport: Any  # transport.host.Transport
    tuner: Autotuner | None

    def apply_tuned_setting(
        self, fusion_threshold: int, cycle_time: float, bands: tuple[Band, ...] = ...
    ) -> None: ...

    def tunable_algorithms(self) -> tuple[tuple[str, ...], AlgorithmTable | None]: ...


logger = logging.getLogger(__name__)

FUSION_GRID: tuple[int, ...] = (
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    128 << 20,
)
"""Fusion thresholds tried, in bytes: powers of 4 from 64 KiB, and 128 MiB (a ResNet-50's
gradients in one buffer); the search cuts it above the largest cycle's bytes."""

CONFIRM_WITHIN = 0.15
"""A runner-up scoring within this much (relative) of the best is scored again with it."""

CYCLE_MARGIN = 0.10
"""How much better (relative) a setting with a cycle time must score than one without to be
preferred to it, in the search and on the final re-scores. Any cycle time above 0 switches
off the engine's caller-run cycles and its gathering of a burst of submissions into one
cycle: 0.5 ms, which the model prices at 0.5 ms a cycle, cost 0 to 38% on the CI machine
(docs/benchmarks.md, Autotune), and a small win of one is mostly noise."""

RESCORES = 3
"""The most final re-scores (the best, the start, a runner-up): the search keeps room for
them in its budget."""

MIN_SAMPLES_TO_RESCORE = 6
"""The smallest budget (samples) that keeps room for the re-scores; a smaller one searches
to its end and keeps the best first score."""

TABLE = "table"
"""What the log's ``allreduce_algorithm`` column says of a :class:`Candidate` that leaves
every size to the algorithm table."""

MODEL_SKIP = 2.0
"""An algorithm that the table's models (`AlgorithmTable.models`, by `Model.cost`) price at
more than this many times the table's choice on a band's buffers is not tried there (on the
CI machine forcing MPI's allreduce scored 0.33 to 0.83 of the table's choice, recursive
doubling 0.24 to 1.02: the models' order held; their ratios are microbenchmarks')."""

CYCLE_GRID_MS: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
"""Cycle times tried, in milliseconds."""

LATENCY_SECONDS = 50e-6
"""The model's cost of one collective beyond its bytes (an MPI allreduce of a few bytes on
2 ranks of the CI machine: 30 to 60 us). Only the order of the candidates depends on it."""

_NO_STEP_CYCLES = 10_000
"""Cycles without a repeated name after which rank 0 warns that no step can be seen."""

CSV_COLUMNS = (
    "sample",
    "fusion_threshold",
    "cycle_time_ms",
    "allreduce_algorithm",
    "allreduce_crossovers",
    "score",
    "best_score",
    "converged",
    "steps",
)
"""The columns of ``RINGPLUG_AUTOTUNE_LOG``: the sample's number (from 1), its setting
(bytes, milliseconds, and the allreduce algorithm: ``table`` for the algorithm table's
choice at every size, else the bands tried in its place, such as ``ring@[64K,128K)``: the
ring from 64 KiB up to, not including, 128 KiB, the table's choice elsewhere), the
allreduce's crossovers that result (``mpi<64K<ring``: MPI's below 64 KiB, the ring from
there on; empty where no table was offered), its score (bytes reduced per second), the
best score so far, 1 on the row after which tuning stopped, and the training steps spent
tuning by the end of it."""


@dataclass(frozen=True)
class Candidate:
    """One setting the search may try: a fusion threshold (bytes), a cycle time (ms) and
    the allreduce's bands (`core.algorithms.Band`: an algorithm on a range of sizes in
    place of the algorithm table's choice there; none: the table's choice at every size)."""

    fusion_threshold: int
    cycle_time_ms: float
    bands: tuple[Band, ...] = ()

    @property
    def algorithm_text(self) -> str:
        """The log's ``allreduce_algorithm``: ``table``, or the bands (``ring@[64K,128K)``,
        several separated by spaces)."""
        return " ".join(str(band) for band in self.bands) or TABLE

    def __str__(self) -> str:
        allreduce = self.algorithm_text if self.bands else "by the table"
        return (
            f"fusion {self.fusion_threshold} B, cycle {self.cycle_time_ms:g} ms, "
            f"allreduce {allreduce}"
        )


class CostModel:
    """The alpha-beta cost of one step's collectives at a setting, from the bytes of each
    cycle of a step measured at the starting setting.

    Each cycle's allreduce bytes go as ceil(bytes / threshold) fused collectives, each
    costing ``latency`` beyond its bytes; each cycle waits the cycle time first. The bytes'
    own cost (beta times the bytes) is the same for every setting and left out.

    Args:
        cycle_bytes: the allreduce bytes of each cycle of one step.
        latency: seconds per collective. Defaults to :data:`LATENCY_SECONDS`.
        buffers: the sizes of a step's fused allreduce buffers at a fusion threshold (bytes
            in, bytes out; :func:`fused_buffers` of the step's plans). Defaults to each
            cycle's bytes cut in buffers of the threshold and one of the rest.
    """

    def __init__(
        self,
        cycle_bytes: Sequence[int],
        latency: float = LATENCY_SECONDS,
        buffers: Callable[[int], list[int]] | None = None,
    ) -> None:
        self.cycle_bytes = [b for b in cycle_bytes if b > 0] or [1]
        self.latency = latency
        self._buffers = buffers

    def buffers(self, threshold: int) -> list[int]:
        """The sizes of one step's fused allreduce buffers at `threshold` (bytes)."""
        if self._buffers is not None:
            return [b for b in self._buffers(threshold) if b > 0]
        found = []
        for nbytes in self.cycle_bytes:
            whole, rest = divmod(nbytes, max(threshold, 1))
            found += [threshold] * whole + ([rest] if rest else [])
        return found

    def step_seconds(self, candidate: Candidate) -> float:
        """The predicted communication time of a step beyond its bytes, in seconds."""
        threshold = max(candidate.fusion_threshold, 1)
        collectives = sum(math.ceil(b / threshold) for b in self.cycle_bytes)
        return self.latency * collectives + candidate.cycle_time_ms * 1e-3 * len(self.cycle_bytes)

    def largest_useful_threshold(self, grid: Sequence[int] = FUSION_GRID) -> int:
        """The smallest threshold of `grid` that fuses the largest cycle whole (the grid's
        largest when none does): larger ones cost the same and take more memory."""
        largest = max(self.cycle_bytes)
        return next((value for value in grid if value >= largest), grid[-1])

    def best(self) -> Candidate:
        """The model's best setting: the largest useful threshold and no cycle time."""
        return Candidate(self.largest_useful_threshold(), CYCLE_GRID_MS[0])


class Search:
    """The deterministic model-guided local search (see the module's docstring): the same
    scores in give the same settings out, on every rank.

    Args:
        start: the setting the job started with (scored first, and again at the end).
        model: the cost model measured at the start.
        max_samples: the most settings scored, the re-scores included.
        margin: how much better (relative) a neighbour must score to become the best.
            Defaults to 0.03.
        algorithms: the allreduce algorithms to try once the threshold and cycle time have
            converged (`core.algorithms` names: the candidates of the job's table), on the
            sizes of the step's fused buffers. Defaults to none.
        table: the job's algorithm table, as it is without autotune's bands (its allreduce
            row says where the buffers fall and what it takes there; its models,
            where measured, order the algorithms and skip the hopeless). Defaults to none:
            no algorithm is tried.
    """

    def __init__(
        self,
        start: Candidate,
        model: CostModel,
        max_samples: int,
        margin: float = 0.03,
        algorithms: Sequence[str] = (),
        table: AlgorithmTable | None = None,
    ) -> None:
        self.model = model
        self.max_samples = max_samples
        self.margin = margin
        self.algorithms = tuple(algorithms) if table is not None else ()
        self.table = table
        # The size ranges whose algorithm is still to be tried (see `band_trials`), each
        # with its algorithms; made when the threshold and cycle time have converged.
        self.bands_left: list[tuple[int, int | None, tuple[str, ...]]] = []
        self.fusion_grid = tuple(v for v in FUSION_GRID if v <= model.largest_useful_threshold())
        # Each setting's score of record: its only score, or the lower of its first two
        # (see `checking`), or its final re-score.
        self.scores: dict[Candidate, float] = {}
        self.order: list[Candidate] = []  # scored, in order
        self.history: list[tuple[Candidate, float]] = []  # each sample's setting and score
        self.start = start
        self.current = start
        self.best: Candidate | None = None
        self.converged = False
        self.queue: list[Candidate] = []  # the coarse spread, then the algorithms to try
        self._spread: set[Candidate] = set()
        # The setting scored again next: a challenger whose one score beat the best's (it
        # takes over only if the lower of its two scores does too), or the spread's best
        # before the local search moves around it. One outlying score leads nowhere.
        self.checking: Candidate | None = None
        self.checked: list[Candidate] = []  # each setting scored twice, in order
        self._searching_algorithms = False  # the threshold and cycle time have converged
        self._confirming: list[Candidate] | None = None  # the final re-scores, in order
        self.rescores: dict[Candidate, float] = {}  # ... their scores

    @property
    def best_score(self) -> float:
        return self.scores[self.best] if self.best is not None else math.nan

    def record(self, score: float) -> Candidate | None:
        """Score the current setting; return the next to try, or ``None`` when the search
        has ended (then :attr:`best` is the setting to keep, and :attr:`converged` says
        whether it converged rather than ran out of samples)."""
        candidate = self.current
        self.order.append(candidate)
        self.history.append((candidate, score))
        if self._confirming is not None:
            return self._confirm(candidate, score)
        if candidate == self.checking:
            self._settle(candidate, score)
        else:
            self.scores[candidate] = score
            if self.best is None:
                self.best = candidate
            elif self._beats(candidate, score, self.best, self.best_score):
                if candidate in self._spread:
                    self.best = candidate  # checked when the spread ends (`_next`)
                else:
                    self.checking = candidate
            coarse = [c for c in self.order if c in self._spread]
            falling = len(coarse) >= 2 and coarse[-1] == candidate
            if falling and self.scores[coarse[-2]] > score * (1 + self.margin):
                # Falling as the threshold falls: the smaller ones are worse still (one best
                # threshold; the local search looks at the neighbours).
                self.queue.clear()
        following = self._next()
        if following is None:
            self.converged = self._searching_algorithms and not self.queue and not self.bands_left
            following = self._start_confirming()
            if following is None:
                self.checking = None  # no room to check it: a challenger is not taken
                return None
        self.current = following
        return following

    def _settle(self, candidate: Candidate, score: float) -> None:
        """A second score of :attr:`checking`. A challenger takes over only if both its
        scores beat the best's (one score that came out too high, on a quiet moment of a
        shared machine, cannot make it the best); the spread's best checked gives way to
        the highest setting that beats it now. Either keeps the mean of its two scores."""
        assert self.best is not None
        self.checking = None
        self.checked.append(candidate)
        first = self.scores[candidate]
        self.scores[candidate] = (first + score) / 2
        if candidate != self.best:
            if self._beats(candidate, min(first, score), self.best, self.best_score):
                self.best = candidate
            return
        rivals = [
            other
            for other, other_score in self.scores.items()
            if self._beats(other, other_score, candidate, self.scores[candidate])
        ]
        if rivals:
            self.best = max(rivals, key=self.scores.__getitem__)

    def _beats(self, candidate: Candidate, score: float, other: Candidate, against: float) -> bool:
        """Whether `candidate` scoring `score` clearly beats `other` scoring `against`: by
        ``margin``, or by :data:`CYCLE_MARGIN` where only `candidate` has a cycle time (its
        cost, the engine's caller-run cycles and burst gathering switched off, varies more
        from one sample to the next than the model can say)."""
        needed = self.margin
        if candidate.cycle_time_ms > 0 and other.cycle_time_ms == 0:
            needed = max(needed, CYCLE_MARGIN)
        return score > against * (1 + needed)

    def contenders(self) -> list[Candidate]:
        """What the final re-scores would score now, in order: the best (or a challenger
        the budget left no room to score again), the start right after it (the best is
        kept only if it beats the start's own second score), and a runner-up: the best
        it challenged; else the best setting with the table's crossovers and no cycle time
        where the best has bands or a cycle time (either is kept only if it
        wins again, clearly); else the highest other setting without cycle time within
        :data:`CONFIRM_WITHIN` of the best. Fewer than two: nothing to re-score."""
        challenger = self.checking if self.checking != self.best else None
        best = challenger or self.best
        if best is None:
            return []
        found = [best]
        if self.start != best:
            found.append(self.start)
        if challenger is not None and self.best not in found:
            assert self.best is not None
            return [*found, self.best]
        others = [c for c in self.scores if c not in found and not c.bands]
        if best.cycle_time_ms > 0 or best.bands:
            others = [c for c in others if c.cycle_time_ms == 0] or others
        else:  # a cycle time that did not beat it clearly gets no second chance
            others = [c for c in others if c.cycle_time_ms == 0]
        if others:
            runner_up = max(others, key=self.scores.__getitem__)
            plainer = best.cycle_time_ms > 0 or bool(best.bands)
            close = self.scores[runner_up] * (1 + CONFIRM_WITHIN) >= self.scores[best]
            if plainer or close:
                found.append(runner_up)
        return found if len(found) >= 2 else []

    def _start_confirming(self) -> Candidate | None:
        """At the end: score the :meth:`contenders` once more, back to back, as many as the
        budget holds (the search leaves room for all: see :meth:`_next`). The best was
        chosen as the highest of noisy scores, so its own is too high; their second scores,
        taken one after the other under the same load, decide."""
        contenders = self.contenders()[: self.max_samples - len(self.order)]
        if len(contenders) < 2:
            return None
        self._confirming = contenders
        return contenders[0]

    def _confirm(self, candidate: Candidate, score: float) -> Candidate | None:
        """A second score of `candidate`; when every contender has one, keep the best of
        the best and the runner-up by their second scores (within the noise, the one the
        model finds cheaper), unless it does not beat the start's second score."""
        assert self._confirming is not None
        self.scores[candidate] = score
        self.rescores[candidate] = score
        waiting = [c for c in self._confirming if c not in self.rescores]
        if waiting:
            self.current = waiting[0]
            return self.current
        self.checking = None
        second = self.rescores
        tuned = [c for c in self._confirming if c != self.start] or [self.start]
        winner = tuned[0]
        for other in tuned[1:]:
            if self._beats(other, second[other], winner, second[winner]):
                winner = other
            elif not self._beats(winner, second[winner], other, second[other]):
                winner = min((winner, other), key=self._model_order)
        if winner != self.start and self.start in second and second[winner] <= second[self.start]:
            winner = self.start  # not faster than where it started: keep the start
        self.best = winner
        return None

    def _next(self) -> Candidate | None:
        """The next setting to score, or ``None`` when the search is over: no untried
        neighbour of the best and no algorithm left to try, or only room left for the
        final re-scores (:data:`RESCORES`, the most there can be after any next score;
        none in a budget too small for them)."""
        reserve = RESCORES if self.max_samples >= MIN_SAMPLES_TO_RESCORE else 0
        if len(self.order) + 1 + reserve > self.max_samples:
            return None
        if self.checking is not None:
            return self.checking
        if len(self.order) == 1:
            self.queue = self.coarse()
            self._spread = set(self.queue)
        while self.queue:
            candidate = self.queue.pop(0)
            if candidate not in self.scores:
                return candidate
        best = self.best
        if best != self.start and best not in self.checked and best in self._spread:
            # The spread's best, on one score: checked before the search moves around it.
            self.checking = best
            return best
        if not self._searching_algorithms:
            untried = self._untried_neighbours()
            if untried:
                return untried[0]
            self._searching_algorithms = True
            assert self.best is not None
            self.bands_left = self.band_trials(self.best.fusion_threshold)
        while True:
            while self.queue:
                candidate = self.queue.pop(0)
                if candidate not in self.scores:
                    return candidate
            if not self.bands_left:
                return None
            # The next range's algorithms, each added to the best's bands so far (a range
            # tuned before keeps the algorithm that won there).
            start, end, names = self.bands_left.pop(0)
            best = self.best
            assert best is not None
            self.queue = [
                Candidate(
                    best.fusion_threshold, best.cycle_time_ms, (*best.bands, Band(name, start, end))
                )
                for name in names
            ]

    def band_trials(self, threshold: int) -> list[tuple[int, int | None, tuple[str, ...]]]:
        """The size ranges of the step's fused allreduce buffers at `threshold` whose
        algorithm is to be tried, the one the table's choice takes most time on first
        (by its models' `Model.cost`; by bytes without them), each with the algorithms to try.

        The buffers are grouped by the band of the table's allreduce row for what MPI can
        reduce (float32 and float64 sums: gradients); a band laid over it covers the other
        row too where that row has the algorithm (16-bit floats keep theirs otherwise). A
        group's range runs from the power of 2 at or below its smallest buffer to the one
        above its largest, cut to the table's band (so every size in it has one table
        choice, and sizes no buffer has keep the table's choice). Its algorithms are those
        of :attr:`algorithms` but the table's choice there, cheapest by the models first,
        less any that the models price at :data:`MODEL_SKIP` times the table's choice or
        more (untried; without a model an algorithm is tried, after those with one)."""
        table = self.table
        if table is None or not self.algorithms:
            return []
        row = table.bands[(ALLREDUCE, True)]
        starts = [start for start, _ in row]
        groups: dict[int, list[int]] = {}
        for nbytes in self.model.buffers(threshold):
            groups.setdefault(bisect.bisect_right(starts, nbytes) - 1, []).append(nbytes)
        found = []
        for index, sizes in groups.items():
            taken = row[index][1]
            band_end = starts[index + 1] if index + 1 < len(starts) else None
            start = max(starts[index], 1 << (min(sizes).bit_length() - 1))
            end: int | None = 1 << max(sizes).bit_length()
            if band_end is not None:
                end = min(end, band_end)
            priced = {name: _priced(table, name, sizes) for name in self.algorithms}
            limit = priced[taken] * MODEL_SKIP if priced[taken] is not None else math.inf
            names = [
                name
                for name in self.algorithms
                if name != taken and (priced[name] is None or priced[name] < limit)
            ]
            names.sort(key=lambda name: (priced[name] is None, priced[name] or 0.0))
            weight = priced[taken] if priced[taken] is not None else float(sum(sizes))
            if names:
                found.append((weight, start, end, tuple(names)))
        found.sort(key=lambda entry: -entry[0])
        return [(start, end, names) for _, start, end, names in found]

    def crossovers(self, candidate: Candidate) -> str:
        """The allreduce's crossovers at `candidate` (its bands laid over :attr:`table`),
        as `AlgorithmTable.row_text` writes them: ``mpi<64K<ring``; ``""`` without a table."""
        if self.table is None:
            return ""
        return self.table.overriding(*candidate.bands).row_text(ALLREDUCE, True)

    def coarse(self) -> list[Candidate]:
        """The model's best setting, then every other fusion threshold below it with no
        cycle time: a spread that finds the region of the best even where the model is
        wrong about the threshold (a fusion buffer larger than the cache costs its copies
        more, which the model leaves out). It stops where the score falls."""
        guess = self.model.best()
        top = self.fusion_grid.index(guess.fusion_threshold)
        return [Candidate(self.fusion_grid[i], guess.cycle_time_ms) for i in range(top, -1, -2)]

    def _untried_neighbours(self) -> list[Candidate]:
        """The untried threshold neighbours without cycle time of the best setting without
        one, while there are any; then the untried neighbours of the best. So cycle times
        wait for the best threshold without one even where the start, with its cycle
        time, stays the best (a lucky first score): its neighbours all have one."""
        assert self.best is not None
        without = [c for c in self.scores if c.cycle_time_ms == 0]
        if without:
            centre = self.best
            if centre.cycle_time_ms > 0:
                centre = max(without, key=self.scores.__getitem__)
            found = [
                c for c in self._neighbours(centre) if c.cycle_time_ms == 0 and c not in self.scores
            ]
            if found:
                return sorted(found, key=self._model_order)
        found = [c for c in self._neighbours(self.best) if c not in self.scores]
        found.sort(key=self._model_order)
        return found

    def _model_order(self, candidate: Candidate) -> tuple[bool, bool, float, int, float]:
        """Every setting without cycle time first (a cycle time costs more than the model
        says: see :data:`CYCLE_MARGIN`), then the table's algorithm before bands of another,
        then cheapest by the model; ties: larger threshold, then shorter cycle time."""
        return (
            candidate.cycle_time_ms > 0,
            bool(candidate.bands),
            self.model.step_seconds(candidate),
            -candidate.fusion_threshold,
            candidate.cycle_time_ms,
        )

    def _neighbours(self, centre: Candidate) -> list[Candidate]:
        found = []
        for value in _adjacent(self.fusion_grid, centre.fusion_threshold):
            found.append(Candidate(value, centre.cycle_time_ms, centre.bands))
        for value in _adjacent(CYCLE_GRID_MS, centre.cycle_time_ms):
            found.append(Candidate(centre.fusion_threshold, value, centre.bands))
        return found


def _adjacent(grid: Sequence[float], value: float) -> list:
    """The grid values next to `value` (for a value off the grid: the nearest one)."""
    if value in grid:
        index = grid.index(value)
        return [grid[i] for i in (index - 1, index + 1) if 0 <= i < len(grid)]
    nearest = min(grid, key=lambda v: (abs(math.log1p(v) - math.log1p(value)), v))
    return [nearest]


def _priced(table: AlgorithmTable, name: str, sizes: Sequence[int]) -> float | None:
    """What `table`'s model of allreduce algorithm `name` costs a step's buffers of `sizes`
    bytes (seconds, by `Model.cost`, as the table's bands are read), or None where the
    table has no model of it."""
    model = table.models.get(SERIES[(ALLREDUCE, name)])
    return None if model is None else sum(model.cost(nbytes) for nbytes in sizes)


def fused_buffers(plans: Sequence[Sequence[Response]], threshold: int) -> list[int]:
    """The bytes of each fused allreduce buffer that `plans` (one step's cycles) run at a
    fusion `threshold`: the engine's own batching (`engine.batches`)."""
    found = []
    for plan in plans:
        for item in batches(list(plan), threshold):
            if isinstance(item, list) and item[0].signature.kind is Kind.ALLREDUCE:
                found.append(allreduce_bytes(item))
    return found


def allreduce_bytes(responses: Sequence[Response]) -> int:
    """The bytes of a plan's allreduces (the kind the fusion threshold groups)."""
    total = 0
    for response in responses:
        signature = response.signature
        if signature.kind is Kind.ALLREDUCE and 0 <= signature.code < len(ITEMSIZE):
            total += math.prod(signature.shape) * ITEMSIZE[signature.code]
    return total


class Autotuner:
    """Tunes one engine's fusion threshold, cycle time and allreduce algorithm bands; every
    rank has one, and they decide alike (see the module's docstring).

    Args:
        settings: the engine's settings at the start (the starting setting, the budget, the
            log file).
        rank: this rank (rank 0 times the samples and writes the log).
        share: broadcasts rank 0's score to every rank (a collective; called at the end of
            the same cycle on every rank) and returns it.
        apply: makes a setting the engine's (fusion threshold in bytes, cycle time in
            seconds, the allreduce's bands: none for the table's choice at every size),
            from the next cycle on.
        clock: the time in seconds. Defaults to ``time.perf_counter``.
        algorithms: called once, at the same cycle on every rank, when the search begins
            (it may be collective): the allreduce algorithms to try, and the algorithm
            table they are tried in (None: none to try). Defaults to none.
    """

    def __init__(
        self,
        settings: Settings,
        rank: int,
        share: Callable[[float], float],
        apply: Callable[[int, float, tuple[Band, ...]], None],
        clock: Callable[[], float] = time.perf_counter,
        algorithms: Callable[[], tuple[Sequence[str], AlgorithmTable | None]] = lambda: (
            (),
            None,
        ),
    ) -> None:
        self.rank = rank
        self._share, self._apply, self._clock = share, apply, clock
        self._algorithms = algorithms
        self.steps_per_sample = settings.autotune_steps_per_sample
        self.warmup_samples = settings.autotune_warmup_samples
        self.max_samples = settings.autotune_max_samples
        self.start = Candidate(settings.fusion_threshold, settings.cycle_time * 1e3)
        self.search: Search | None = None  # made when the warm-up has measured the cycles
        self.done = False
        self.steps = 0  # steps completed since tuning began
        # (cycle, setting) each time this rank applied one, for tests and the log.
        self.applied: list[tuple[int, Candidate]] = []
        self._seen: set[str] = set()  # names of the step in progress
        self._plans: list[Sequence[Response]] = []  # each cycle's plan of this step
        self._step_plans: list[Sequence[Response]] = []  # ... of the last full step
        self._sample_steps = 0
        self._sample_bytes = 0
        self._step_started = math.nan
        self._durations: list[float] = []
        self._log: IO[str] | None = None
        self._writer: Any = None  # a csv.writer
        self._cycles_in_step = 0
        if rank == 0 and settings.autotune_log:
            self._log = open(settings.autotune_log, "w", newline="")  # noqa: SIM115
            self._writer = csv.writer(self._log)
            self._writer.writerow(CSV_COLUMNS)
            self._log.flush()

    def after_cycle(self, cycle: int, responses: Sequence[Response]) -> None:
        """Count a cycle's plan (every rank calls it with the same plan); at the end of a
        sample, score it and apply the next setting."""
        if self.done or not responses:
            return
        names = [response.name for response in responses]
        if not self._seen.isdisjoint(names):
            self._end_step(cycle)
            if self.done:
                return
            self._seen = set()
        self._seen.update(names)
        self._cycles_in_step += 1
        if self._cycles_in_step == _NO_STEP_CYCLES and self.rank == 0:
            logger.warning(
                "autotune has seen %d cycles without a collective name coming again, so it "
                "cannot tell training steps apart and tunes nothing; name the collectives "
                "each step runs (every framework adapter names its gradients)",
                _NO_STEP_CYCLES,
            )
        self._plans.append(responses)
        self._sample_bytes += allreduce_bytes(responses)

    def _end_step(self, cycle: int) -> None:
        self._cycles_in_step = 0
        now = self._clock() if self.rank == 0 else 0.0
        self._durations.append(now - self._step_started)
        self._step_started = now
        self._step_plans, self._plans = self._plans, []
        self.steps += 1
        self._sample_steps += 1
        if self._sample_steps < self.steps_per_sample:
            return
        # The first step of a sample ran across the change of setting (and the first of
        # all is measured from nothing): not timed.
        timed = self._durations[1:]
        step_bytes = self._sample_bytes / self._sample_steps
        self._sample_steps, self._sample_bytes, self._durations = 0, 0, []
        if self.warmup_samples > 0:
            self.warmup_samples -= 1
            return
        if self.search is None:
            names, table = self._algorithms()
            plans = self._step_plans  # the buffers of a step measured at the start
            self.search = Search(
                self.start,
                CostModel(
                    self.step_cycle_bytes,
                    buffers=lambda threshold: fused_buffers(plans, threshold),
                ),
                self.max_samples,
                algorithms=names,
                table=table,
            )
        # Their total time, not a median of step times: rank 0's step boundaries jitter as
        # the peers run ahead or behind (a short step then a long one), which a sum of
        # consecutive steps cancels and a median of them does not.
        score = step_bytes * len(timed) / max(sum(timed), 1e-9) if self.rank == 0 else 0.0
        score = self._share(score)
        search = self.search
        following = search.record(score)
        if following is None:
            assert search.best is not None
            self.done = True
            self._set(cycle, search.best)
        else:
            self._set(cycle, following)
        self._write_row(search)

    @property
    def step_cycle_bytes(self) -> list[int]:
        """The allreduce bytes of each cycle of the last full step."""
        return [allreduce_bytes(plan) for plan in self._step_plans]

    def _set(self, cycle: int, candidate: Candidate) -> None:
        self.applied.append((cycle, candidate))
        self._apply(candidate.fusion_threshold, candidate.cycle_time_ms * 1e-3, candidate.bands)
        if self.done and self.rank == 0:
            logger.info(
                "autotune %s after %d steps: %s",
                "converged" if self.search and self.search.converged else "ran out of samples",
                self.steps,
                candidate,
            )

    def _write_row(self, search: Search) -> None:
        if self._writer is None or self._log is None:
            return
        tried, score = search.history[-1]
        self._writer.writerow(
            (
                len(search.order),
                tried.fusion_threshold,
                f"{tried.cycle_time_ms:g}",
                tried.algorithm_text,
                search.crossovers(tried),
                f"{score:.6g}",
                f"{search.best_score:.6g}",
                int(self.done),
                self.steps,
            )
        )
        self._log.flush()
        if self.done:
            self.close()

    def close(self) -> None:
        """Close the log file (at the end of tuning, or when the engine stops)."""
        if self._log is not None:
            self._log.close()
            self._log, self._writer = None, None


def for_engine(engine: Tunable) -> Autotuner:
    """The tuner of the world's engine: rank 0's score goes to every rank through the
    engine's transport (an MPI broadcast with the engine's deadline), and a new setting
    becomes the engine's through `Engine.apply_tuned_setting`."""

    def share(score: float) -> float:
        waiter = engine.waiter
        waiter.begin(waiter.cycle, waiter.index + 1, "autotune's broadcast of rank 0's score")
        buffer = np.array([score], np.float64)
        engine.transport.broadcast(buffer, 0)
        return float(buffer[0])

    return Autotuner(
        engine.settings,
        engine.rank,
        share,
        engine.apply_tuned_setting,
        algorithms=engine.tunable_algorithms,
    )


def tune_from(engine: Tunable, fusion_threshold: int, cycle_time: float) -> Autotuner:
    """Make `fusion_threshold` (bytes) and `cycle_time` (seconds) `engine`'s setting and tune
    afresh from there, with the budget of its settings (benchmarks and tests start from a
    bad setting this way; ``RINGPLUG_AUTOTUNE=1`` refuses a fixed one). Every rank calls it
    at the same point, with no collective in flight (after a barrier). The allreduce
    goes back to the table's choice at every size."""
    if engine.tuner is not None:
        engine.tuner.close()
    engine.apply_tuned_setting(fusion_threshold, cycle_time, ())
    engine.tuner = for_engine(engine)
    return engine.tuner
