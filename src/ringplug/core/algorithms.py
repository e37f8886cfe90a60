"""The algorithm table: which algorithm moves a collective of a given size on this job's ranks.

One table per communicator (the world, each process set) answers
``table.choose(kind, nbytes, mpi_reduces)`` with an algorithm name:

- ``allreduce``: ``mpi`` (MPI's own Allreduce), ``doubling`` (recursive doubling,
  `transport.doubling`), ``ring`` (ringplug's bandwidth-optimal ring) or, on ranks of more
  than one host with more than one rank on some host, ``hierarchical`` (within each host,
  among one rank per host, within each host again: `transport.hierarchical`);
- ``reducescatter``: ``mpi`` or ``doubling`` (an allreduce of the whole buffer, each rank
  keeping its block) or ``ring`` (the ring's reduce-scatter half);
- ``allgather``: ``mpi`` (MPI's Allgatherv) or ``ring``;
- ``broadcast``: ``mpi`` (MPI's Bcast) or ``chain`` (a pipelined chain from the root).

``mpi_reduces`` says whether MPI can reduce the dtype and op at all (16-bit floats, and Max
and Min of floats, which must propagate NaN as numpy does, it cannot): without it only the
algorithms that reduce in numpy are candidates.

The table is a list of bands per (kind, mpi_reduces): from this many bytes on, that
algorithm. Its bands come from measurement (`transport.calibration`: each candidate timed at
a few sizes on this job's ranks, an alpha-beta model fitted to each, the crossovers where
the models cross), from the cache of an earlier measurement, or, with
`RINGPLUG_CALIBRATION=fixed`, from the fixed table of `RINGPLUG_RING_THRESHOLD`. Rank 0
makes it and every rank receives the same bytes, so every rank chooses alike: a rank that
chose another algorithm would deadlock.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import bytes_text

ALLREDUCE = "allreduce"
REDUCESCATTER = "reducescatter"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
KINDS = (ALLREDUCE, REDUCESCATTER, ALLGATHER, BROADCAST)

MPI = "mpi"
DOUBLING = "doubling"
RING = "ring"
CHAIN = "chain"
HIERARCHICAL = "hierarchical"

CANDIDATES: dict[tuple[str, bool], tuple[str, ...]] = {
    (ALLREDUCE, True): (MPI, DOUBLING, RING, HIERARCHICAL),
    (ALLREDUCE, False): (DOUBLING, RING, HIERARCHICAL),
    (REDUCESCATTER, True): (MPI, DOUBLING, RING),
    (REDUCESCATTER, False): (DOUBLING, RING),
    (ALLGATHER, True): (MPI, RING),
    (BROADCAST, True): (MPI, CHAIN),
}
"""The algorithms each row of the table chooses among (allgather and broadcast reduce
nothing: only their ``True`` row exists, and `AlgorithmTable.choose` reads it).
``hierarchical`` is a candidate only where it was measured (`OPTIONAL`): on ranks of
several hosts."""

OPTIONAL = frozenset({HIERARCHICAL})
"""Candidates whose series a measurement may lack (the job's ranks are not placed for it):
`table_from_models` leaves them out of the bands then."""

SERIES: dict[tuple[str, str], str] = {
    (ALLREDUCE, MPI): "allreduce/mpi",
    (ALLREDUCE, DOUBLING): "allreduce/doubling",
    (ALLREDUCE, RING): "allreduce/ring",
    (ALLREDUCE, HIERARCHICAL): "allreduce/hierarchical",
    # A small reduce-scatter is an allreduce of the whole buffer: the same cost.
    (REDUCESCATTER, MPI): "allreduce/mpi",
    (REDUCESCATTER, DOUBLING): "allreduce/doubling",
    (REDUCESCATTER, RING): "reducescatter/ring",
    (ALLGATHER, MPI): "allgather/mpi",
    (ALLGATHER, RING): "allgather/ring",
    (BROADCAST, MPI): "broadcast/mpi",
    (BROADCAST, CHAIN): "broadcast/chain",
}
"""The measured series whose model prices each (kind, algorithm)."""

MEASURED = "measured"
CACHED = "cached"
FIXED = "fixed"

# Of the cached JSON; a different one is measured again (2: hierarchical; 3: bands from the
# measured points, `bands_from_points`).
_FORMAT = 3


@dataclass(frozen=True)
class Model:
    """An alpha-beta model of one algorithm, fitted to its measured points.

    Args:
        alpha: seconds per call whatever the size (the messages' latency, Python's calls).
        beta: seconds per byte of the buffer.
        points: the measured (bytes, seconds) it was fitted to, by size.
        error: the largest relative error of the model on those points (0.1: 10%).
    """

    alpha: float
    beta: float
    points: tuple[tuple[int, float], ...] = ()
    error: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """The fitted line's time of one call on `nbytes` bytes."""
        return self.alpha + self.beta * nbytes

    def cost(self, nbytes: float) -> float:
        """The time of one call on `nbytes` bytes as the measured points say it, what the
        table's bands and the autotuner's prices are read from: between two measured sizes,
        the line through their points; above the last, the last such line; below the
        first, the first point's time (nothing was measured there). The fitted line
        (`seconds`) where fewer than two points were measured.

        A line fitted over every size misplaces a crossover wherever an algorithm's cost
        bends: MPI's own allreduce changes algorithm with the size, and its fit put the
        ring from 149 KB on 2 ranks here, where MPI's allreduce was faster up to 2-4 MiB
        (docs/benchmarks.md, "Crossovers from the measured points")."""
        points = self.points
        if len(points) < 2:
            return self.seconds(nbytes)
        if nbytes <= points[0][0]:
            return points[0][1]
        index = min(bisect.bisect_left(points, (nbytes,)), len(points) - 1)
        return _through(points[index - 1], points[index]).seconds(nbytes)


def fit(points: Sequence[tuple[int, float]]) -> Model:
    """The alpha-beta model with the least squared relative error on `points` ((bytes,
    seconds), at least one), with alpha and beta not negative.

    Relative, so that the 4 KiB point counts as much as the 4 MiB one: the crossovers of
    small sizes depend on alpha, which the large points alone would swamp.
    """
    if not points:
        raise ValueError("an alpha-beta fit needs at least one measured point")
    sizes = [float(n) for n, _ in points]
    times = [float(t) for _, t in points]

    def squared(alpha: float, beta: float) -> float:
        return sum(((alpha + beta * n - t) / t) ** 2 for n, t in zip(sizes, times, strict=True))

    candidates = []
    # Unconstrained least squares of (alpha + beta n) / t against 1 (normal equations).
    saa = sum(1 / t**2 for t in times)
    sab = sum(n / t**2 for n, t in zip(sizes, times, strict=True))
    sbb = sum(n**2 / t**2 for n, t in zip(sizes, times, strict=True))
    sa = sum(1 / t for t in times)
    sb = sum(n / t for n, t in zip(sizes, times, strict=True))
    det = saa * sbb - sab * sab
    if det > 1e-12 * saa * sbb:
        alpha, beta = (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det
        if alpha >= 0 and beta >= 0:
            candidates.append((alpha, beta))
    # On the boundary: one of the two is 0.
    candidates.append((sa / saa, 0.0))
    if sbb > 0:
        candidates.append((0.0, sb / sbb))
    alpha, beta = min(candidates, key=lambda ab: squared(*ab))
    error = max(abs(alpha + beta * n - t) / t for n, t in zip(sizes, times, strict=True))
    points = tuple(sorted((int(n), t) for n, t in zip(sizes, times, strict=True)))
    return Model(alpha, beta, points, error)


def bands_from_models(models: Mapping[str, Model]) -> tuple[tuple[int, str], ...]:
    """The cheapest of `models` (algorithm -> model) by size: ((from bytes, algorithm), ...),
    the first from 0. Ties go to the algorithm named first."""
    names = list(models)
    edges = {0}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ma, mb = models[a], models[b]
            if ma.beta != mb.beta:
                crossing = (mb.alpha - ma.alpha) / (ma.beta - mb.beta)
                if 0 < crossing < 2**62:
                    # rounded first: 225000.00000000003 is 225,000 bytes
                    edges.add(math.ceil(round(crossing, 6)))
    ordered = sorted(edges)
    bands: list[tuple[int, str]] = []
    for k, start in enumerate(ordered):
        # The winner inside this interval (its middle, or past the last edge).
        probe = start * 2 + 1 if k + 1 == len(ordered) else (start + ordered[k + 1]) / 2
        winner = min(names, key=lambda name: (models[name].seconds(probe), names.index(name)))
        if not bands or bands[-1][1] != winner:
            bands.append((start, winner))
    return tuple(bands)


def bands_from_points(models: Mapping[str, Model]) -> tuple[tuple[int, str], ...]:
    """The cheapest of `models` by size by their `Model.cost`: ((from bytes, algorithm),
    ...), the first from 0; ties go to the algorithm named first. `bands_from_models` where
    no model has measured points.

    Between two sizes that any model was measured at, each model's cost is a line (its
    breaks lie at its own measured sizes), so the crossovers there are those of the lines
    through each model's costs at the two sizes; past the last size, of the lines that
    hold on.
    """
    sizes = sorted({n for model in models.values() for n, _ in model.points})
    if not sizes:
        return bands_from_models(models)
    starts = [0, *sizes]
    bands: list[tuple[int, str]] = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else None
        other = end if end is not None else 2 * start
        lines = {
            name: _through((start, m.cost(start)), (other, m.cost(other)))
            for name, m in models.items()
        }
        piece = bands_from_models(lines)
        holding = [name for edge, name in piece if edge <= start][-1]
        inside = [(e, name) for e, name in piece if e > start and (end is None or e < end)]
        for edge, name in [(start, holding), *inside]:
            if not bands or bands[-1][1] != name:
                bands.append((edge, name))
    return tuple(bands)


def _through(first: tuple[int, float], second: tuple[int, float]) -> Model:
    """The line through two measured (bytes, seconds) points."""
    beta = (second[1] - first[1]) / (second[0] - first[0])
    return Model(first[1] - beta * first[0], beta)


@dataclass(frozen=True)
class Band:
    """One algorithm for the collectives of one kind from `start` bytes up to, not including,
    `end` (``None``: every larger size): what autotune tries in place of the table's choice
    on the sizes a job's fused buffers have (`AlgorithmTable.overriding`).

    Args:
        algorithm: a candidate of `kind` (`CANDIDATES`), such as ``"ring"``.
        start: the smallest size it takes, in bytes.
        end: the first size it does not take; ``None`` for no end. Defaults to ``None``.
        kind: the collective kind. Defaults to ``"allreduce"``.
    """

    algorithm: str
    start: int
    end: int | None = None
    kind: str = ALLREDUCE

    def __str__(self) -> str:
        """``ring@[64K,4M)``: the algorithm, then the sizes it takes (``inf``: no end)."""
        end = "inf" if self.end is None else bytes_text(self.end)
        return f"{self.algorithm}@[{bytes_text(self.start)},{end})"

    def covers(self, nbytes: int) -> bool:
        """Whether a collective of `nbytes` bytes falls in this band."""
        return self.start <= nbytes and (self.end is None or nbytes < self.end)


@dataclass(frozen=True)
class AlgorithmTable:
    """The algorithm of every collective kind by size, for one communicator's ranks.

    Args:
        size: the number of ranks it was made for.
        bands: (kind, mpi_reduces) -> ((from bytes, algorithm), ...), the first from 0.
        source: how it was made: ``"measured"``, ``"cached"`` (an earlier measurement of
            the same hosts, rank count, MPI library and ringplug version) or ``"fixed"``.
        models: series name (``"allreduce/ring"``, see `SERIES`) -> its fitted model
            (empty for a fixed table).
        seconds: how long the measurement took (0 for a fixed table).
        note: why the table is what it is, when not measured (for the log and the bench).
    """

    size: int
    bands: Mapping[tuple[str, bool], tuple[tuple[int, str], ...]]
    source: str = FIXED
    models: Mapping[str, Model] = field(default_factory=dict)
    seconds: float = 0.0
    note: str = ""

    def choose(self, kind: str, nbytes: int, mpi_reduces: bool = True) -> str:
        """The algorithm for a `kind` collective of `nbytes` bytes (the whole buffer: an
        allgather's result, a reduce-scatter's input)."""
        if kind in (ALLGATHER, BROADCAST):
            mpi_reduces = True
        bands = self.bands[(kind, mpi_reduces)]
        starts = [start for start, _ in bands]
        return bands[bisect.bisect_right(starts, nbytes) - 1][1]

    def crossovers(self) -> list[tuple[str, bool, int, str, str]]:
        """Every change of algorithm: (kind, mpi_reduces, bytes, below, from there on)."""
        found = []
        for (kind, reduces), bands in self.bands.items():
            for (_, below), (start, above) in zip(bands, bands[1:], strict=False):
                found.append((kind, reduces, start, below, above))
        return found

    def forcing(self, forced: Mapping[str, str]) -> AlgorithmTable:
        """This table with `forced` (kind -> algorithm) used at every size (the rows whose
        candidates lack it keep their bands: Max of float16 cannot take MPI's)."""
        bands = dict(self.bands)
        for (kind, reduces), _ in self.bands.items():
            if kind in forced and forced[kind] in CANDIDATES[(kind, reduces)]:
                bands[(kind, reduces)] = ((0, forced[kind]),)
        note = ", ".join(f"{kind}={name}" for kind, name in forced.items())
        return AlgorithmTable(
            self.size, bands, self.source, self.models, self.seconds, f"forced {note}"
        )

    def overriding(self, *bands: Band) -> AlgorithmTable:
        """This table with each of `bands` laid over it in order: a band's algorithm on its
        sizes and every other size as it was, so the crossovers at the band's edges move (an
        algorithm taken on both sides of an edge leaves none there) and the others stay.
        Rows whose candidates lack the algorithm keep their bands (Max of float16 cannot
        take MPI's). No bands: this table.

        Raises:
            ValueError: an unknown kind, an algorithm no row of the kind has, or a range
                that is empty or starts below 0, saying what is allowed.
        """
        table = self
        for band in bands:
            table = table._with_band(band)
        return table

    def _with_band(self, band: Band) -> AlgorithmTable:
        """`overriding` with one band."""
        offered = sorted(_offered(band.kind))
        if not offered:
            raise ValueError(
                f"algorithm band {band}: {band.kind!r} is no collective kind; use one of "
                f"{', '.join(KINDS)}."
            )
        if band.algorithm not in offered:
            raise ValueError(
                f"algorithm band {band}: {band.kind} has no algorithm {band.algorithm!r}; use "
                f"one of {', '.join(offered)}."
            )
        if band.start < 0 or (band.end is not None and band.end <= band.start):
            raise ValueError(
                f"algorithm band {band.algorithm}: sizes from {band.start} to {band.end} bytes "
                "are no range; give 0 <= start < end (end None for no end)."
            )
        bands = dict(self.bands)
        for (kind, reduces), rows in self.bands.items():
            if kind != band.kind or band.algorithm not in CANDIDATES[(kind, reduces)]:
                continue
            edges = sorted({start for start, _ in rows} | {band.start} | {band.end or 0})
            merged: list[tuple[int, str]] = []
            for edge in edges:
                name = band.algorithm if band.covers(edge) else self.choose(kind, edge, reduces)
                if not merged or merged[-1][1] != name:
                    merged.append((edge, name))
            bands[(kind, reduces)] = tuple(merged)
        note = f"{self.note}; {band}" if self.note else str(band)
        return AlgorithmTable(self.size, bands, self.source, self.models, self.seconds, note)

    def row_text(self, kind: str = ALLREDUCE, mpi_reduces: bool = True) -> str:
        """One row's bands as text: ``mpi<64K<ring`` (MPI's below 64 KiB, the ring from
        there on)."""
        parts = []
        for start, name in self.bands[(kind, mpi_reduces)]:
            if start:
                parts.append(bytes_text(start))
            parts.append(name)
        return "<".join(parts)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": _FORMAT,
                "size": self.size,
                "source": self.source,
                "seconds": self.seconds,
                "note": self.note,
                "bands": [
                    [kind, reduces, [list(band) for band in bands]]
                    for (kind, reduces), bands in self.bands.items()
                ],
                "models": {
                    name: {
                        "alpha": m.alpha,
                        "beta": m.beta,
                        "error": m.error,
                        "points": [list(p) for p in m.points],
                    }
                    for name, m in self.models.items()
                },
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> AlgorithmTable:
        """The table `to_json` wrote. Raises ValueError on any other text."""
        try:
            data = json.loads(text)
            if data.get("format") != _FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {_FORMAT}")
            bands = {
                (str(kind), bool(reduces)): tuple((int(s), str(a)) for s, a in rows)
                for kind, reduces, rows in data["bands"]
            }
            models = {
                name: Model(
                    float(m["alpha"]),
                    float(m["beta"]),
                    tuple((int(n), float(t)) for n, t in m["points"]),
                    float(m["error"]),
                )
                for name, m in data["models"].items()
            }
            table = cls(
                int(data["size"]),
                bands,
                str(data["source"]),
                models,
                float(data["seconds"]),
                str(data["note"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not an algorithm table: {exc}") from None
        missing = [row for row in CANDIDATES if row not in table.bands]
        wrong = [
            (row, name)
            for row, rows in table.bands.items()
            for _, name in rows
            if row not in CANDIDATES or name not in CANDIDATES[row]
        ]
        if missing or wrong:
            raise ValueError(f"not an algorithm table: rows missing {missing}, unknown {wrong}")
        return table


def fixed_table(size: int, ring_threshold: int, note: str = "") -> AlgorithmTable:
    """The table without measurement: below `ring_threshold` bytes MPI's own collectives
    (recursive doubling where MPI cannot reduce), the ring from there on; MPI's allgather
    and broadcast at every size (ringplug's behaviour before the table)."""
    return AlgorithmTable(
        size,
        {
            (ALLREDUCE, True): ((0, MPI), (ring_threshold, RING)),
            (ALLREDUCE, False): ((0, DOUBLING), (ring_threshold, RING)),
            (REDUCESCATTER, True): ((0, MPI), (ring_threshold, RING)),
            (REDUCESCATTER, False): ((0, DOUBLING), (ring_threshold, RING)),
            (ALLGATHER, True): ((0, MPI),),
            (BROADCAST, True): ((0, MPI),),
        },
        FIXED,
        note=note or f"fixed: the ring from {ring_threshold} bytes",
    )


def _offered(kind: str) -> set[str]:
    """The algorithms some row of `kind` has (none for a name that is no kind)."""
    return {
        name for (row_kind, _), names in CANDIDATES.items() if row_kind == kind for name in names
    }


def table_from_models(size: int, models: Mapping[str, Model], seconds: float) -> AlgorithmTable:
    """The measured table: each row's bands from the models of its candidates (an
    `OPTIONAL` one only where `models` has its series)."""
    bands = {}
    for (kind, reduces), names in CANDIDATES.items():
        priced = {
            name: models[SERIES[(kind, name)]]
            for name in names
            if name not in OPTIONAL or SERIES[(kind, name)] in models
        }
        bands[(kind, reduces)] = bands_from_points(priced)
    return AlgorithmTable(size, bands, MEASURED, dict(models), seconds)


def parse_forced(text: str | None) -> dict[str, str]:
    """``RINGPLUG_ALGORITHM``'s value as kind -> algorithm: ``"allreduce=ring,allgather=mpi"``,
    or one name for every kind that has it (``"ring"``, ``"mpi"``).

    Raises:
        ValueError: a kind or algorithm that does not exist, saying which do.
    """
    if not text or not text.strip():
        return {}
    offered = {kind: _offered(kind) for kind in KINDS}
    every = sorted(set().union(*offered.values()))
    forced: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            if part not in every:
                raise ValueError(
                    f"RINGPLUG_ALGORITHM: {part!r} is no algorithm; use one of {', '.join(every)}, "
                    "or kind=algorithm pairs such as allreduce=ring,broadcast=mpi."
                )
            forced.update({kind: part for kind in KINDS if part in offered[kind]})
            continue
        kind, name = (s.strip() for s in part.split("=", 1))
        if kind not in offered:
            raise ValueError(
                f"RINGPLUG_ALGORITHM: {kind!r} is no collective kind; use {', '.join(KINDS)}."
            )
        if name not in offered[kind]:
            raise ValueError(
                f"RINGPLUG_ALGORITHM: {kind} has no algorithm {name!r}; use one of "
                f"{', '.join(sorted(offered[kind]))}."
            )
        forced[kind] = name
    return forced


# ------------------------------------------------------------------------------ the cache
def cache_directory(environ: Mapping[str, str] | None = None) -> Path:
    """Where measured tables are kept: ``$XDG_CACHE_HOME/ringplug``, else
    ``~/.cache/ringplug``."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ringplug"


def cache_key(hosts: Iterable[str], mpi_library: str, version: str) -> str:
    """The name of the cached table of a job: every rank's host (in rank order, so the
    rank count and placement are in it), the MPI library's version line and ringplug's."""
    text = json.dumps([list(hosts), mpi_library, version, _FORMAT])
    return "algorithms-" + hashlib.sha256(text.encode()).hexdigest()[:20]


def load_cached(directory: Path, key: str, size: int) -> AlgorithmTable | None:
    """The cached table of `key`, or None (absent, unreadable, another rank count)."""
    try:
        table = AlgorithmTable.from_json((directory / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    if table.size != size or table.source not in (MEASURED, CACHED):
        return None
    return AlgorithmTable(table.size, table.bands, CACHED, table.models, table.seconds)


def save_cached(directory: Path, key: str, table: AlgorithmTable) -> Path:
    """Write `table` as the cache of `key` (atomically: a rename). Raises OSError."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(table.to_json())
    partial.replace(path)
    return path
