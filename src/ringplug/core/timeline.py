"""A Chrome trace of what the engine did, one row per tensor (opens in Perfetto).

Numbered calls (``torch.default#12``, one name per call) share one row (``torch.default``),
each span naming its call.

Spans per request: QUEUE (submitted, waiting for the engine), NEGOTIATE (announced,
waiting for every rank), COPY_IN, ALLREDUCE/BROADCAST/... (the collective), COPY_OUT;
plus an instant marker for every engine cycle. Written as a JSON array of trace events,
flushed every cycle and closed on `stop()`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any


class Timeline:
    """Collects trace events on the engine thread and appends them to one file."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file: IO[str] | None = open(path, "w")  # noqa: SIM115 - closed by stop()
        self._file.write("[\n")
        self._lock = threading.Lock()
        self._first = True
        self._rows: dict[str, int] = {}
        self._tracks: set[int] = set()  # ranks with a training-step track
        self._events: list[dict[str, Any]] = []
        self._origin = time.perf_counter()
        self._meta("process_name", 0, {"name": f"ringplug rank {rank}"})
        self._meta("thread_name", 0, {"name": "engine cycles"})

    def _us(self, seconds: float) -> float:
        return round((seconds - self._origin) * 1e6, 3)

    def _meta(self, kind: str, tid: int, args: dict[str, Any]) -> None:
        self._events.append({"name": kind, "ph": "M", "pid": self.rank, "tid": tid, "args": args})

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._meta("thread_name", row, {"name": name})
            self._meta("thread_sort_index", row, {"sort_index": row})
        return row

    def span(self, name: str, phase: str, start: float, end: float, **args: Any) -> None:
        """One phase of one tensor, from `start` to `end` (time.perf_counter seconds)."""
        row, numbered, _ = name.partition("#")
        if numbered:
            args["call"] = name
        with self._lock:
            duration = round(max(end - start, 0.0) * 1e6, 3)
            event = {
                "name": phase,
                "ph": "X",
                "pid": self.rank,
                "tid": self._row(row),
                "ts": self._us(start),
                "dur": duration,
            }
            if args:
                event["args"] = args
            self._events.append(event)

    def track(self, rank: int, phase: str, start: float, end: float) -> None:
        """One phase of one training step of `rank`, on that rank's own track (its process
        group in Perfetto), so every rank's data wait, compute and communication line up."""
        with self._lock:
            if rank not in self._tracks:
                self._tracks.add(rank)
                pid = 1000 + rank  # apart from the engine's pid (its rank)
                self._events.append(
                    {
                        "name": "process_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": 0,
                        "args": {"name": f"rank {rank} training steps"},
                    }
                )
            self._events.append(
                {
                    "name": phase,
                    "ph": "X",
                    "pid": 1000 + rank,
                    "tid": 0,
                    "ts": self._us(start),
                    "dur": round(max(end - start, 0.0) * 1e6, 3),
                }
            )

    def marker(self, label: str, when: float, **args: Any) -> None:
        """An instant event on the engine row (one per cycle)."""
        with self._lock:
            self._events.append(
                {
                    "name": label,
                    "ph": "i",
                    "s": "t",
                    "pid": self.rank,
                    "tid": 0,
                    "ts": self._us(when),
                    "args": args,
                }
            )

    def flush(self) -> None:
        """Append the events collected so far to the file."""
        with self._lock:
            self._write()

    def _write(self) -> None:
        if self._file is not None and self._events:
            separator = ",\n"
            text = separator.join(json.dumps(event) for event in self._events)
            self._file.write(("" if self._first else separator) + text)
            self._file.flush()
            self._first = False
        self._events.clear()

    def stop(self) -> None:
        """Write what is left and close the array, so the file is valid JSON."""
        self.marker("timeline stopped", time.perf_counter())
        with self._lock:
            if self._file is None:
                return
            self._write()
            self._file.write("\n]\n")
            self._file.close()
            self._file = None
