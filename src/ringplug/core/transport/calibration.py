"""Measuring the algorithm table on this job's own ranks, within a deadline, and caching it.

At a communicator's first collective that chooses an algorithm, `agreed_table` makes its
`AlgorithmTable`: the fixed one when `RINGPLUG_RING_THRESHOLD` is set or
`RINGPLUG_CALIBRATION=fixed`; else rank 0 looks for the table cached for these hosts (every
rank's, in rank order), MPI library and ringplug version, and sends it to every rank; when
there is none, every rank measures together (`measure`), rank 0 fits and sends the table
and caches it. `RINGPLUG_ALGORITHM` is applied last.

The measurement times each candidate (`core.algorithms.SERIES`) at a few sizes, smallest
first, all candidates at one size before the next size. After each size the ranks take
the maximum over ranks of each median (the collective is as slow as its slowest rank) and
of the seconds spent so far: the same numbers everywhere, so every rank takes the same
decision to stop when the next size would pass `RINGPLUG_CALIBRATION_SECONDS`.
"""

from __future__ import annotations

import importlib.metadata
import logging
import statistics
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from ...config import FIXED_RING_THRESHOLD, Settings
from ..algorithms import (
    ALLREDUCE,
    CACHED,
    CHAIN,
    DOUBLING,
    HIERARCHICAL,
    MPI,
    RING,
    AlgorithmTable,
    Model,
    cache_directory,
    cache_key,
    fit,
    fixed_table,
    load_cached,
    save_cached,
    table_from_models,
)
from ..dtypes import DType
from ..ops import ReduceOp
from . import ring


class Transport(Protocol):
    """What the calibration uses of `host.Transport` (which calls it: importing that here
    would close an import circle)."""

    rank: int
    size: int
    settings: Settings
    forced: dict[str, str]

    def allreduce_by(self, algorithm: str, flat: np.ndarray, op: ReduceOp, code: DType) -> None:
        """Allreduce `flat` in place by `algorithm`."""

    def reducescatter_by(
        self, algorithm: str, work: np.ndarray, bounds: list[int], op: ReduceOp, code: DType
    ) -> None:
        """Reduce-scatter `work` in place by `algorithm`, into blocks at `bounds`."""

    def allgather_by(
        self, algorithm: str, send: np.ndarray, rows: list[int], out: np.ndarray
    ) -> None:
        """Gather every rank's `send` (`rows` each) into `out` by `algorithm`."""

    def broadcast_by(self, algorithm: str, buf: np.ndarray, root: int) -> None:
        """Broadcast `buf` from `root` by `algorithm`."""

    def allgather_texts(self, text: str) -> list[str]:
        """Every rank's `text`."""

    def broadcast_text(self, text: str, root: int) -> str:
        """`root`'s `text`."""

    def barrier(self) -> None:
        """Wait for every rank."""

    def hosts(self) -> list[str]:
        """Each rank's host, in rank order."""

    def spans_hosts(self) -> bool:
        """Whether the hierarchical allreduce is a candidate."""


logger = logging.getLogger(__name__)

SIZES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)
"""The buffer sizes measured (bytes), smallest first: two below the usual crossovers, two
where the ring's bandwidth shows."""

_REPEATS = {4 << 10: 16, 64 << 10: 8, 512 << 10: 4, 4 << 20: 2}
_BATCHES = 5


def agreed_table(transport: Transport) -> AlgorithmTable:
    """The table of `transport`'s communicator, the same on every rank (collective).

    Raises:
        ValueError: on every rank alike, where `RINGPLUG_ALGORITHM` forces the hierarchical
            allreduce on ranks that are not on several hosts.
    """
    settings = transport.settings
    if transport.forced.get(ALLREDUCE) == HIERARCHICAL and (
        transport.size == 1 or not transport.spans_hosts()
    ):
        from . import hierarchical

        raise ValueError(
            "RINGPLUG_ALGORITHM forces allreduce=hierarchical, which needs ranks on more "
            "than one host with more than one rank on some host, but "
            f"{hierarchical.why_not(transport.hosts() if transport.size > 1 else ['this host'])}"
            "; unset it, or force another allreduce (mpi, doubling, ring)."
        )
    if (
        settings.ring_threshold is not None
        or settings.calibration == "fixed"
        or transport.size == 1
    ):
        threshold = settings.ring_threshold
        why = "RINGPLUG_RING_THRESHOLD" if threshold is not None else "RINGPLUG_CALIBRATION=fixed"
        if threshold is None:
            threshold = FIXED_RING_THRESHOLD
        table = fixed_table(
            transport.size, threshold, f"fixed ({why}): the ring from {threshold} bytes"
        )
    else:
        table = _cached_or_measured(transport)
    if transport.forced:
        table = table.forcing(transport.forced)
    if transport.rank == 0:
        logger.info("algorithm table on %d ranks: %s", transport.size, describe(table))
    return table


def _cached_or_measured(transport: Transport) -> AlgorithmTable:
    from mpi4py import MPI as mpi

    hosts = transport.hosts()
    key = cache_key(hosts, mpi.Get_library_version().splitlines()[0].strip(), _version())
    directory = cache_directory()
    found = None
    if transport.rank == 0 and transport.settings.calibration == "auto":
        found = load_cached(directory, key, transport.size)
    text = transport.broadcast_text(found.to_json() if found is not None else "", 0)
    if text:
        return AlgorithmTable.from_json(text)
    table = measure(transport, transport.settings.calibration_seconds)
    if transport.rank == 0 and table.source != CACHED and table.models:
        try:
            path = save_cached(directory, key, table)
            logger.info("algorithm table measured in %.2f s, cached in %s", table.seconds, path)
        except OSError as exc:
            logger.warning("could not cache the algorithm table in %s: %s", directory, exc)
    return table


def measure(transport: Transport, deadline_s: float) -> AlgorithmTable:
    """Time every candidate on this communicator's ranks, fit, and return rank 0's table
    (collective; at most about `deadline_s` seconds)."""
    start = time.perf_counter()
    runs = _runs(transport)
    for run in runs.values():  # MPI's connections made, code paths warm
        run(SIZES[0])
    points: dict[str, list[tuple[int, float]]] = {name: [] for name in runs}
    elapsed, durations = 0.0, []
    for index, nbytes in enumerate(SIZES):
        medians = _seconds_per_call(transport, list(runs.values()), nbytes, _REPEATS[nbytes])
        mine = np.array([*medians, time.perf_counter() - start], np.float64)
        transport.allreduce_by(MPI, mine, ReduceOp.MAX, DType.FLOAT64)
        for name, seconds in zip(runs, mine[:-1], strict=True):
            points[name].append((nbytes, float(seconds)))
        # Only numbers every rank holds (maxima over ranks) decide whether to go on.
        durations.append(float(mine[-1]) - elapsed)
        elapsed = float(mine[-1])
        if index + 1 < len(SIZES) and elapsed + _ahead(durations, index) > deadline_s:
            break
    measured = len(next(iter(points.values())))
    if measured < 2:
        return fixed_table(
            transport.size,
            FIXED_RING_THRESHOLD,
            f"fixed: only {measured} size measured within {deadline_s:g} s",
        )
    table: AlgorithmTable | None = None
    if transport.rank == 0:
        models = {name: fit(series) for name, series in points.items()}
        table = table_from_models(transport.size, models, elapsed)
    text = transport.broadcast_text(table.to_json() if table is not None else "", 0)
    return AlgorithmTable.from_json(text)


def _ahead(durations: list[float], index: int) -> float:
    """The predicted seconds of size `index + 1`: the durations so far extended linearly in
    bytes (at least the last one's)."""
    if index == 0:
        return 2 * durations[0]
    slope = (durations[-1] - durations[-2]) / (SIZES[index] - SIZES[index - 1])
    return max(durations[-1], durations[-1] + slope * (SIZES[index + 1] - SIZES[index]))


def _seconds_per_call(
    transport: Transport, runs: list[Callable[[int], None]], nbytes: int, repeats: int
) -> list[float]:
    """This rank's seconds per call of each of `runs`: the median over `_BATCHES` batches
    of `repeats` back-to-back calls each. The batches of the runs take turns, each started
    together (a barrier), so that a change of the machine's load falls on
    every run alike; the median, as on a shared machine a call now and then waits for a
    descheduled rank. The first batch of each run starts with a warm call."""
    times: list[list[float]] = [[] for _ in runs]
    for batch in range(_BATCHES):
        for run, kept in zip(runs, times, strict=True):
            if batch == 0:
                run(nbytes)  # warm: the buffer touched
            transport.barrier()
            for _ in range(repeats):
                began = time.perf_counter()
                run(nbytes)
                kept.append(time.perf_counter() - began)
    return [statistics.median(kept) for kept in times]


def _runs(transport: Transport) -> dict[str, Callable[[int], None]]:
    """Series name -> one call of that algorithm on a float32 buffer of so many bytes."""
    size, rank = transport.size, transport.rank
    buffers: dict[int, np.ndarray] = {}

    def buffer(nbytes: int) -> np.ndarray:
        if nbytes not in buffers:
            buffers[nbytes] = np.zeros(nbytes // 4, np.float32)
        return buffers[nbytes]

    def allreduce(algorithm: str) -> Callable[[int], None]:
        return lambda n: transport.allreduce_by(algorithm, buffer(n), ReduceOp.SUM, DType.FLOAT32)

    def reducescatter_ring(n: int) -> None:
        work = buffer(n)
        bounds = ring.even_bounds(work.size, size)
        transport.reducescatter_by(RING, work, bounds, ReduceOp.SUM, DType.FLOAT32)

    def allgather(algorithm: str) -> Callable[[int], None]:
        def run(n: int) -> None:
            out = buffer(n)
            rows = [hi - lo for lo, hi in _pairs(ring.even_bounds(out.size, size))]
            send = np.zeros(rows[rank], np.float32)
            transport.allgather_by(algorithm, send, rows, out)

        return run

    def broadcast(algorithm: str) -> Callable[[int], None]:
        return lambda n: transport.broadcast_by(algorithm, buffer(n), 0)

    runs = {
        "allreduce/mpi": allreduce(MPI),
        "allreduce/doubling": allreduce(DOUBLING),
        "allreduce/ring": allreduce(RING),
        "reducescatter/ring": reducescatter_ring,
        "allgather/mpi": allgather(MPI),
        "allgather/ring": allgather(RING),
        "broadcast/mpi": broadcast(MPI),
        "broadcast/chain": broadcast(CHAIN),
    }
    if transport.spans_hosts():
        runs["allreduce/hierarchical"] = allreduce(HIERARCHICAL)
    return runs


def _pairs(bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds, bounds[1:], strict=False))


def describe(table: AlgorithmTable) -> str:
    """One line: the table's source and its bands."""
    rows = []
    for (kind, reduces), bands in table.bands.items():
        label = kind if reduces or kind in ("allgather", "broadcast") else f"{kind} (not MPI's)"
        rows.append(f"{label}: " + ", ".join(f"{name} from {start}" for start, name in bands))
    how = table.note or f"{table.source} ({table.seconds:.2f} s)"
    return f"{how}; " + "; ".join(rows)


def model_text(model: Model) -> str:
    """``alpha 12.3 us + 0.45 ns/B (max error 8%)``."""
    return (
        f"alpha {model.alpha * 1e6:.1f} us + {model.beta * 1e9:.3f} ns/B "
        f"(max error {model.error * 100:.0f}%)"
    )


def _version() -> str:
    """ringplug's installed version (read from its metadata: importing the package from
    here would close an import circle)."""
    try:
        return importlib.metadata.version("ringplug")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
