"""Each rank's flight record: its last collectives, and what they say about a hang.

The engine keeps the last `RINGPLUG_FLIGHT_RECORD` collectives of its rank in a ring
buffer (`FlightRecorder`): the number of each in the rank's sequence, its name, kind, size,
call site, and when it was submitted, entered negotiation and completed. Recording one
costs a list of a few fields and a look at the caller's frame (usually one frame, known by
its code object's id; the line is worked out only when the record is written), not a copy
of anything: about 5,000 instructions (0.6-0.7 us) of CPU per synchronous unnamed call. On
2 ranks that is 1.6 us, 10-11% of a synchronous 4 KiB allreduce (`ringplug-bench allreduce
--impls ringplug,ringplug-norecord`, 2026-12-07), above the 5% issue 44 asks for
(docs/benchmarks.md, "The flight record on small calls").

On a stall (when rank 0 warns about it), a timeout or an engine failure every rank that
can writes its record: under ringrun as an event that ringrun gathers into one file per job
(the path printed), else into a file of its own in the temporary folder (the path logged).
`explain` reads those and says where the ranks parted: the first collective submitted
differently, which ranks wait in which collective, which never came.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ringplug import config

from .stacks import Frame, is_user_frame

_OWN = str(Path(__file__).resolve().parents[1])  # ringplug's own frames are not call sites
# ...except those of `ringplug-bench`, a program that calls ringplug as users' do: its lines
# are the call sites, so that its calls record what a user's calls record.
_CALLERS = str(Path(__file__).resolve().parents[1] / "bench") + os.sep
_SEARCH_DEPTH = 10  # frames above ringplug's searched for a user frame

# Entry layout (a list: one allocation, stores by index).
_SEQ, _NAME, _SIGNATURE, _SITE, _SUBMITTED, _ANNOUNCED, _DONE, _FAILED = range(8)


def _site_at(depth: int, usual: int) -> tuple[Any, int] | None:
    """The call site `depth` frames above the caller of this function: the frame `usual`
    frames further up where it is known to be the user's (one frame object, not a walk),
    else the innermost user frame found by a walk (`_call_site`)."""
    if usual:
        try:
            frame = sys._getframe(depth + usual + 1)
        except ValueError:
            frame = None
        if frame is not None and id(frame.f_code) in _USERS:
            return (frame.f_code, frame.f_lasti)
    return _call_site(depth + 2)


class FlightRecorder:
    """The last `capacity` collectives of this rank (0: records nothing).

    `submitted` and `done` run under the engine's lock, on whichever thread submits or
    completes: they only store.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._ring: list[list[Any] | None] = [None] * self.capacity
        self._count = 0
        self._open: dict[str, list[Any]] = {}
        # Where each name was first submitted from (`note_site`), by name: (code, offset of
        # the calling instruction), see `_call_site`.
        self.sites: dict[str, tuple[Any, int] | None] = {}

    def note_site(self, name: str, depth: int = 2, usual: int = 0) -> None:
        """On the submitting thread: remember where `name` is submitted from (the caller
        `depth` frames up), the first time only: a training step submits the same names
        from the same places every step, and walking the frames costs microseconds.

        `usual`: how many frames above that the user's frame usually is (0: unknown); a
        name that never repeats (an unnamed call's) is looked for there first, one frame
        instead of a walk. `add_latest` takes such a name's site out again."""
        if self.capacity and name not in self.sites:
            if len(self.sites) >= _SITES_KEPT:
                self.sites.clear()
            self.sites[name] = _site_at(depth, usual)

    def add(
        self, name: str, signature: Any, submitted: float, track: bool = False
    ) -> list[Any] | None:
        """Record `name`, submitted at `submitted` (perf_counter); return its entry, for
        `finish` (None when recording nothing). With `track` the entry is kept by name too
        (a call without a request: `tracked`, `finish_named`, `forget`)."""
        if not self.capacity:
            return None
        site = self.sites.get(name)
        entry = [self._count, name, signature, site, submitted, 0.0, 0.0, ""]
        self._ring[self._count % self.capacity] = entry
        self._count += 1
        if track:
            self._open[name] = entry
        return entry

    def add_latest(self, requests: Sequence[Any]) -> None:
        """Record each of `requests` (its `name`, `signature`, `submitted` and `cacheable`:
        whether its name repeats), setting its
        `flight` to its entry; of a batch longer than the ring only the last `capacity`,
        all that the ring would keep of it (a step of 1000 small tensors records 128)."""
        skipped = len(requests) - self.capacity
        if skipped > 0:
            self._count += skipped
            requests = requests[skipped:]
        ring, capacity, sites = self._ring, self.capacity, self.sites
        count = self._count
        for request in requests:
            name = request.name
            entry = [
                count,
                name,
                request.signature,
                # a name that never repeats (an unnamed call's) leaves `sites` again
                sites.get(name) if request.cacheable else sites.pop(name, None),
                request.submitted,
                0.0,
                0.0,
                "",
            ]
            ring[count % capacity] = entry
            request.flight = entry
            count += 1
        self._count = count

    def add_own(self, request: Any, up: int) -> None:
        """`add_latest` of the one request whose cycle its submitting thread runs now (a
        synchronous call's), with its call site: a name that repeats, where it was first
        submitted from (`note_site`); one that never repeats (an unnamed call's, not kept in
        `sites`), the frame `up` frames above this function's when it is the user's (one
        frame looked at, the usual case), else the innermost user frame (`_call_site`)."""
        name = request.name
        if request.cacheable:
            sites = self.sites
            site = sites.get(name)
            if site is None and name not in sites:
                self.note_site(name, 3)  # walked from `Scheduler.submit` up
                site = sites[name]
        else:
            # `_site_at`, written out: this runs on every unnamed synchronous call
            try:
                frame = sys._getframe(up)
            except ValueError:  # called from fewer frames than usual
                frame = None
            code = frame.f_code if frame is not None else None
            site = (code, frame.f_lasti) if id(code) in _USERS else _site_above(frame)
        count = self._count
        entry = [count, name, request.signature, site, request.submitted, 0.0, 0.0, ""]
        self._ring[count % self.capacity] = entry
        request.flight = entry
        self._count = count + 1

    def tracked(self, name: str) -> list[Any] | None:
        """The entry `submitted(track=True)` keeps for `name` (a request adopts it)."""
        return self._open.pop(name, None)

    def forget(self, name: str) -> None:
        """Take back the latest entry, `name`'s tracked one, which never ran (it is submitted
        anew)."""
        entry = self._open.pop(name, None)
        if entry is not None and entry[_SEQ] == self._count - 1:
            self._count -= 1
            self._ring[entry[_SEQ] % self.capacity] = None

    def finish_named(self, name: str) -> None:
        """Record that the tracked `name` completed now."""
        finish(self._open.pop(name, None), 0.0, time.perf_counter())

    def records(
        self,
        describe: Callable[[Any], tuple[str, int]],
        announced: Mapping[str, float] | None = None,
    ) -> list[dict[str, Any]]:
        """The record, oldest first, as plain data with wall-clock times.

        `describe(signature)` gives a collective's kind and bytes; `announced` the time a
        still pending request entered negotiation (perf_counter), by name.
        """
        offset = time.time() - time.perf_counter()
        start = max(0, self._count - self.capacity)
        out = []
        for seq in range(start, self._count):
            entry = self._ring[seq % self.capacity]
            if entry is None or entry[_SEQ] != seq:
                continue
            kind, nbytes = describe(entry[_SIGNATURE])
            sent = entry[_ANNOUNCED] or (announced or {}).get(entry[_NAME], 0.0)
            out.append(
                {
                    "seq": seq,
                    "name": entry[_NAME],
                    "kind": kind,
                    "bytes": nbytes,
                    "site": _site_text(entry[_SITE]),
                    "submitted": entry[_SUBMITTED] + offset,
                    "negotiating": sent + offset if sent else None,
                    "completed": entry[_DONE] + offset if entry[_DONE] else None,
                    "state": "failed"
                    if entry[_FAILED]
                    else ("done" if entry[_DONE] else "pending"),
                    "error": entry[_FAILED] or None,
                }
            )
        return out


# id(code object) -> (the code object, what its frames are: 0 ringplug's own, 1 a
# library's, 2 the user's). By id: a code object's hash covers its constants, names and
# bytes each time (15 us for a script's top level, whose loop calls ringplug); the code
# object is kept, so its id is never another's.
_KINDS: dict[int, tuple[Any, int]] = {}
_USERS: set[int] = set()  # the ids of the user's code objects in `_KINDS`
# id(code object) -> (the code object, the ids of the code of the frames above one of its
# frames up to the site, when last walked: `_site_above`). Ids of code objects in `_KINDS`,
# which keeps them, so no id is another's.
_CHAINS: dict[int, tuple[Any, tuple[int, ...]]] = {}
_MOST_FRAMES = 40  # walked up from the submission, at most
_SITES_KEPT = 4096


def _frame_kind(code: Any) -> int:
    known = _KINDS.get(id(code))
    if known is not None:
        return known[1]
    name = code.co_filename
    if name.startswith(_CALLERS):
        kind = 2
    elif name.startswith(_OWN):
        kind = 0
    else:
        kind = 2 if is_user_frame(Frame(name, 0, "")) else 1
    _KINDS[id(code)] = (code, kind)
    if kind == 2:
        _USERS.add(id(code))
    return kind


def finish(
    entry: list[Any] | None, announced: float, now: float, error: BaseException | None = None
) -> None:
    """Record that the collective of `entry` (None: not recorded) completed at `now`, having
    entered negotiation at `announced`, or failed with `error`."""
    if entry is not None:
        entry[_ANNOUNCED] = announced
        entry[_DONE] = now
        if error is not None:
            entry[_FAILED] = f"{type(error).__name__}: {error}"[:300]


def _call_site(depth: int) -> tuple[Any, int] | None:
    """(code, instruction offset) of the caller: the innermost user frame within
    `_SEARCH_DEPTH` frames above ringplug's own, else the first frame outside ringplug. One
    dictionary lookup per frame (the answer is kept per code object). The line is found
    from the offset only when the record is written (`_site_text`): a frame's line number
    is searched for in its code's line table, which costs more the longer its function."""
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    return _walk(frame)[0]


def _site_above(frame: Any) -> tuple[Any, int] | None:
    """`_call_site` from `frame` (None: none), remembered by the chain of functions walked.

    The walk's answer depends only on the code objects it passes, so where the frames
    above `frame` run the same functions as the last walk from `frame`'s function (a call
    through a framework layer, `ringplug.torch` or the Horovod API, takes the same way
    every time), the site is the frame at the same height, found by comparing each
    frame's code with the chain kept (`_CHAINS`), which costs less than judging it."""
    if frame is None:
        return None
    kept = _CHAINS.get(id(frame.f_code))
    if kept is not None:
        above = frame
        for code_id in kept[1]:
            above = above.f_back
            if above is None or id(above.f_code) != code_id:
                break
        else:
            return above.f_code, above.f_lasti
    site, chain = _walk(frame)
    if site is not None:
        _CHAINS[id(frame.f_code)] = (frame.f_code, chain)
    return site


def _walk(frame: Any) -> tuple[tuple[Any, int] | None, tuple[int, ...]]:
    """`_call_site` from `frame` up, and the ids of the code of the frames above `frame` up
    to the site's."""
    first, first_at = None, 0
    outside = 0
    kinds = _KINDS
    passed = []
    for _ in range(_MOST_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        known = kinds.get(id(code))  # a call each frame costs more than the walk
        kind = known[1] if known is not None else _frame_kind(code)
        if kind == 2:
            return (code, frame.f_lasti), tuple(passed[1:] + [id(code)]) if passed else ()
        if kind == 1:
            if first is None:
                first, first_at = frame, len(passed)
            outside += 1
            if outside > _SEARCH_DEPTH:
                break
        passed.append(id(code))
        frame = frame.f_back
    if first is None:
        return None, ()
    return (first.f_code, first.f_lasti), tuple(passed[1 : first_at + 1])


def _line(code: Any, offset: int) -> int:
    """The line of the instruction at byte `offset` of `code` (0: unknown)."""
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line or 0
    return 0


def _site_text(site: tuple[Any, int] | None) -> str:
    if site is None:
        return "?"
    code, offset = site
    return f"{code.co_filename}:{_line(code, offset)} in {code.co_name}"


# ---------------------------------------------------------------------------- files
def write_own(
    rank: int, host: str, reason: str, records: list[dict[str, Any]], folder: str | None = None
) -> Path:
    """Write one rank's record to a file of its own (without ringrun); return its path."""
    directory = Path(folder or config.FLIGHT_DIR.read() or _temporary())
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ringplug-flight.rank-{rank}.{os.getpid()}.json"
    own = {"host": host, "reason": reason, "written": time.time(), "records": records}
    job = {"ranks": {str(rank): own}}
    path.write_text(json.dumps(job, indent=1))
    return path


def _temporary() -> str:
    import tempfile

    return tempfile.gettempdir()


def load(paths: Sequence[str | os.PathLike[str]]) -> dict[int, dict[str, Any]]:
    """Every rank's record from job files (ringrun's) or per-rank files, merged by rank.

    Raises:
        ValueError: a file that is not a flight record, saying which.
    """
    ranks: dict[int, dict[str, Any]] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            for rank, record in data["ranks"].items():
                ranks[int(rank)] = record
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{path} is not a ringplug flight record: {error}") from error
    return ranks


# ---------------------------------------------------------------------------- explaining
def _where(record: Mapping[str, Any]) -> str:
    size = record.get("bytes") or 0
    amount = f", {size / 2**20:.1f} MiB" if size >= 2**20 else (f", {size} B" if size else "")
    return f"{record['kind']} {record['name']!r} (#{record['seq']}{amount}, from {record['site']})"


def explain(ranks: Mapping[int, Mapping[str, Any]], size: int | None = None) -> list[str]:
    """Where the ranks' collectives parted, in lines for people.

    `size` is the job's world size when known: ranks without a record are named too.
    """
    if not ranks:
        return ["no flight record of any rank"]
    lines: list[str] = []
    world = size if size is not None else max(ranks) + 1
    silent = [r for r in range(world) if r not in ranks]
    records = {r: list(ranks[r].get("records", [])) for r in sorted(ranks)}
    by_seq = {r: {e["seq"]: e for e in entries} for r, entries in records.items()}
    last = {
        r: max(entries, key=lambda e: e["seq"]) if entries else None
        for r, entries in records.items()
    }
    # The first collective number that the ranks submitted differently, or that some lack.
    common = [set(seqs) for seqs in by_seq.values() if seqs]
    low = max((min(s) for s in common), default=0)
    high = max((max(s) for s in common), default=-1)
    for seq in range(low, high + 1):
        seen: dict[tuple[str, str], list[int]] = {}
        lacking = []
        for rank in records:
            entry = by_seq[rank].get(seq)
            if entry is None:
                lacking.append(rank)
            else:
                seen.setdefault((entry["kind"], entry["name"]), []).append(rank)
        if len(seen) > 1:
            lines.append(f"the ranks parted at collective #{seq}:")
            for holders in sorted(seen.values()):
                entry = by_seq[holders[0]][seq]
                lines.append(
                    f"  rank{_s(holders)} {_list(holders)}: {_where(entry)}, {entry['state']}"
                )
            break
        if lacking and seen:
            (holders,) = seen.values()
            entry = by_seq[holders[0]][seq]
            if entry["state"] == "pending":
                waits = "wait" if len(holders) > 1 else "waits"
                lines.append(
                    f"rank{_s(lacking)} {_list(lacking)} never submitted collective #{seq}, "
                    f"{_where(entry)}, which rank{_s(holders)} {_list(holders)} {waits} in"
                )
            else:
                lines.append(
                    f"rank{_s(lacking)} {_list(lacking)} stopped before collective #{seq}, "
                    f"{_where(entry)}"
                )
            for rank in lacking:
                before = last[rank]
                lines.append(
                    f"  rank {rank}'s last collective: {_where(before)}, {before['state']}"
                    if before
                    else f"  rank {rank} recorded no collective"
                )
            break
    for rank, entries in records.items():
        pending = [e for e in entries if e["state"] == "pending"]
        failed = [e for e in entries if e["state"] == "failed"]
        if pending:
            oldest = pending[0]
            waited = (ranks[rank].get("written") or time.time()) - oldest["submitted"]
            lines.append(f"rank {rank} waits in {_where(oldest)} for {waited:.0f} s")
        for entry in failed[:1]:
            lines.append(f"rank {rank}: {_where(entry)} failed: {entry['error']}")
    if silent:
        lines.append(
            f"rank{_s(silent)} {_list(silent)} wrote no flight record (it did not answer: "
            "stopped, killed, or unable to run Python)"
        )
    if not lines:
        lines.append(f"every rank's record agrees up to collective #{high}: no divergence recorded")
    return lines


def _s(ranks: Sequence[int]) -> str:
    return "s" if len(ranks) > 1 else ""


def _list(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ringplug.forensics FILE...``: explain flight records."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m ringplug.forensics",
        description="Say where the ranks' collectives parted, from ringplug flight records.",
    )
    parser.add_argument("files", nargs="+", help="ringrun's job file or the ranks' own files")
    parser.add_argument("--size", type=int, help="the job's number of ranks")
    args = parser.parse_args(argv)
    try:
        ranks = load(args.files)
    except ValueError as error:
        print(f"ringplug.forensics: {error}", file=sys.stderr)
        return 2
    for line in explain(ranks, args.size):
        print(line)
    return 0
