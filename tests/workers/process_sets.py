"""Multi-rank worker: process sets in the core (every kind against numpy, overlapping sets in
flight at once, the bad inputs), in one job per world size.

Run as ``ringrun -np N python tests/workers/process_sets.py OUTDIR`` (N >= 3); each rank
writes OUTDIR/sets-<rank>.json: {case: {"ok": bool, "detail": str}}. The sets, for a world of
p ranks: A = 0..p-2 (not a power of two on 4 ranks), B = {1, p-1} (passed as [p-1, 1]; it
overlaps A at rank 1), C = {0, p-1} (two ranks, for Adasum).

Sets made by their members only (``members_only=True``): L = 0..p-2, made and used while rank
p-1 is blocked elsewhere (it waits for a file the members write when done) and rank 0 has the
application's receive from any source with any tag pending on MPI_COMM_WORLD (rank p-1 sends
it its message once L is done); P = {0, p-1} and Q = 1..p-2, made at once by disjoint groups of
ranks, twice each.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ringplug
from ringplug.core import process_sets as sets
from ringplug.core import runtime
from ringplug.core.transport.traffic import difference


def set_ranks(size: int) -> dict[str, list[int]]:
    return {"A": list(range(size - 1)), "B": [1, size - 1], "C": [0, size - 1]}


def local_ranks(size: int) -> dict[str, list[int]]:
    """The members-only sets: L, then P and Q (disjoint, made at once)."""
    return {"L": list(range(size - 1)), "P": [0, size - 1], "Q": list(range(1, size - 1))}


KINDS = (
    "allreduce-sum",
    "allreduce-average-large",
    "allreduce-max",
    "unnamed-allreduces",
    "grouped-allreduce",
    "allgather",
    "broadcast",
    "reducescatter",
    "alltoall",
    "barrier",
    "allgather-object",
    "broadcast-object",
    "rank-and-size",
    "negotiation-grows-with-the-set",
    "join",
)


def expected_case_names(rank: int, size: int) -> list[str]:
    """What rank `rank` must report, so that a test notices cases that vanished."""
    names = ["ids-agree"]
    for label, members in set_ranks(size).items():
        if rank in members:
            names += [f"{label}/{kind}" for kind in KINDS]
        else:
            names.append(f"{label}/refused-on-a-non-member")
    if rank in set_ranks(size)["C"]:
        names.append("C/adasum")
    names += ["overlapping-sets-in-flight"]
    if rank in local_ranks(size)["L"]:
        names += [f"L/{kind}" for kind in KINDS if kind != "negotiation-grows-with-the-set"]
        names += ["L/named-apart-from-the-world", "L/removed-by-its-members"]
        if rank == 0:
            names.append("L/any-source-receive-takes-the-applications-message")
    else:
        names.append("L/non-member-blocked-meanwhile")
    names += ["PQ/disjoint-sets-at-once", "PQ/ids-unique-and-counted"]
    names.append("local-bad/caller-not-in-its-ranks")
    if rank in local_ranks(size)["P"]:
        names.append("local-bad/removed-by-the-world")
    if rank in (0, 1):
        names.append("local-bad/duplicate-ranks")
    names += [
        "bad/duplicate-ranks",
        "bad/rank-outside-the-world",
        "bad/not-a-list-of-ranks",
        "bad/ranks-disagree",
        "bad/ids-disagree",
        "bad/remove-with-work-pending",
        "bad/removed-set-refused",
        "world-still-works",
    ]
    if rank in set_ranks(size)["B"]:
        names += ["B/mismatch-names-tensor-and-set", "B/barrier-timeout-names-world-rank"]
    return names


def data(world_rank: int, count: int, salt: int) -> np.ndarray:
    return (np.arange(count, dtype=np.float64) % 97) * (world_rank + 1) + salt


def run_kinds(check, ps, label: str, rank: int) -> None:
    members = list(ps.ranks)
    k = len(members)
    me = members.index(rank)

    def reduce(op, count, salt):
        stacked = np.stack([data(r, count, salt) for r in members])
        return {"sum": stacked.sum(0), "average": stacked.mean(0), "max": stacked.max(0)}[op]

    check(
        f"{label}/allreduce-sum",
        lambda: np.allclose(
            ps.allreduce(data(rank, 1001, 1), op=ringplug.Sum, name="s"), reduce("sum", 1001, 1)
        ),
    )
    # 4 MiB of float32: ringplug's ring among the set's members.
    big = data(rank, 1 << 20, 2).astype(np.float32)
    check(
        f"{label}/allreduce-average-large",
        lambda: np.allclose(ps.allreduce(big, name="big"), reduce("average", 1 << 20, 2), 1e-5),
    )
    check(
        f"{label}/allreduce-max",
        lambda: np.array_equal(
            ps.allreduce(data(rank, 7, 3), op=ringplug.Max, name="m"), reduce("max", 7, 3)
        ),
    )

    def unnamed():
        results = [ps.allreduce(data(rank, 5, salt), op=ringplug.Sum) for salt in (4, 5, 6)]
        return all(
            np.allclose(r, reduce("sum", 5, s)) for r, s in zip(results, (4, 5, 6), strict=True)
        )

    check(f"{label}/unnamed-allreduces", unnamed)

    def grouped():
        results = ps.grouped_allreduce(
            [data(rank, 3, 7), data(rank, 11, 8)], op=ringplug.Sum, name="g"
        )
        return np.allclose(results[0], reduce("sum", 3, 7)) and np.allclose(
            results[1], reduce("sum", 11, 8)
        )

    check(f"{label}/grouped-allreduce", grouped)

    def allgather():
        mine = np.full((me + 1, 2), float(rank))
        expected = np.concatenate([np.full((i + 1, 2), float(r)) for i, r in enumerate(members)])
        return np.array_equal(ps.allgather(mine, name="ag"), expected)

    check(f"{label}/allgather", allgather)
    # The root counts in the set: its last member.
    check(
        f"{label}/broadcast",
        lambda: np.array_equal(
            ps.broadcast(data(rank, 9, 9), root_rank=k - 1, name="b"), data(members[-1], 9, 9)
        ),
    )

    def reducescatter():
        rows = 5
        full = reduce("sum", rows * 3, 10).reshape(rows, 3)
        block = ps.reducescatter(data(rank, rows * 3, 10).reshape(rows, 3), op=ringplug.Sum)
        base, extra = divmod(rows, k)
        start = me * base + min(me, extra)
        return np.allclose(block, full[start : start + base + (1 if me < extra else 0)])

    check(f"{label}/reducescatter", reducescatter)

    def alltoall():
        # Member s sends d + 1 rows of (10 * world rank of s + d) to member d.
        rows = np.concatenate([np.full((d + 1, 2), 10.0 * rank + d) for d in range(k)])
        received, counts = ps.alltoall(rows, splits=[d + 1 for d in range(k)], name="a2a")
        expected = np.concatenate([np.full((me + 1, 2), 10.0 * r + me) for r in members])
        return np.array_equal(received, expected) and list(counts) == [me + 1] * k

    check(f"{label}/alltoall", alltoall)
    check(f"{label}/barrier", lambda: ps.barrier(name="bar") is None or True)
    check(
        f"{label}/allgather-object",
        lambda: ps.allgather_object(("w", rank)) == [("w", r) for r in members],
    )
    check(
        f"{label}/broadcast-object",
        lambda: ps.broadcast_object({"from": rank}, root_rank=0) == {"from": members[0]},
    )
    check(f"{label}/rank-and-size", lambda: (ps.rank(), ps.size()) == (me, k))

    def join():
        # The set's last member joins at once; the others reduce once more without it.
        if me == k - 1:
            last = ps.join()
        else:
            total = ps.allreduce(np.full(2, float(rank)), op=ringplug.Sum, name="after-join")
            last = ps.join()
            if total.tolist() != [float(sum(members[:-1]))] * 2:
                return False, f"sum without the joined member: {total}"
        seen = ps.allgather_object(last)
        return len(set(seen)) == 1 and last in range(k), f"last to join: {seen}"

    check(f"{label}/join", join)


def counted(ps) -> tuple[bool, str]:
    """A repeated small allreduce on `ps`: ceil(log2 k) negotiation messages per call on this
    rank (its data rides in them up to 7 ranks), none through the world's engine. Called
    while every other rank waits outside every engine (`quiet_barrier`): a world collective
    begun elsewhere would have this rank's idle world engine answer it."""
    k, calls = ps.size(), 20
    ps.allreduce(np.ones(4), name="counted")
    world = runtime.world_engine()
    before, world_before = ps._engine.traffic.snapshot(), world.traffic.snapshot()
    cycles_before = ps._engine.counters.cycles_run
    for _ in range(calls):
        ps.allreduce(np.ones(4), name="counted")
    sent = difference(ps._engine.traffic.snapshot(), before)
    world_sent = difference(world.traffic.snapshot(), world_before)
    # Usually one cycle a call; a peer that begins a cycle before this rank submits costs
    # one more (its message then says nothing is ready here).
    cycles = ps._engine.counters.cycles_run - cycles_before
    rounds = math.ceil(math.log2(k))
    negotiation = sent.get("messages", {}).get("negotiation", 0)
    return (
        calls <= cycles and 0 < negotiation <= cycles * rounds and not world_sent.get("messages"),
        f"set of {k}: {sent} in {cycles} cycles; world: {world_sent}",
    )


def quiet_barrier(comm, seconds: float = 120.0) -> None:
    """Every rank meets here on a communicator of its own, outside ringplug's engines."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {comm.Get_rank()}: a peer never reached the barrier")
        time.sleep(0.001)


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = float(np.dot(a, b))
    return (1 - dot / (2 * float(np.dot(a, a)))) * a + (1 - dot / (2 * float(np.dot(b, b)))) * b


def raises(error_type, *fragments):
    """A check that `call` raises `error_type` with every fragment in its message."""

    def verdict(call):
        try:
            call()
        except error_type as exc:
            text = str(exc)
            missing = [f for f in fragments if f not in text]
            return (not missing, f"{type(exc).__name__}: {text}; missing {missing}")
        except Exception as exc:  # noqa: BLE001 - the detail names it
            return (False, f"raised {type(exc).__name__} instead: {exc}")
        return (False, "did not raise")

    return verdict


def members_only(check, report: dict, rank: int, size: int, outdir: Path) -> None:
    """Sets made by their members only: every kind on L while its non-member is blocked
    elsewhere, P and Q made at once by disjoint ranks, and the bad inputs."""
    local = local_ranks(size)
    done = outdir / "L-done"
    if rank == 0:
        # The application's own receive on MPI_COMM_WORLD, from any source with any tag (as
        # mpi4py users write), pending while the members exchange their proposals.
        received = MPI.COMM_WORLD.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    if rank in local["L"]:
        ps = sets.add_process_set(local["L"], members_only=True)
        run_kinds(check, ps, "L", rank)
        check(
            "L/named-apart-from-the-world",
            lambda: (
                ps.process_set_id == "[" + ",".join(map(str, local["L"])) + "]#0"
                and ps.members_only
                and f"process set {ps.process_set_id} (world ranks 0, 1" in ps.describe()
            ),
        )

        def removed():
            sets.remove_process_set(ps, members_only=True)
            return ps not in sets.all_process_sets()

        check("L/removed-by-its-members", removed)
        if rank == 0:
            # Whole when it appears: rank p-1 reads it as soon as it exists.
            written = outdir / "L-done.tmp"
            written.write_text("the members made, used and removed L")
            written.replace(done)

            def applications_message():
                status = MPI.Status()
                deadline = time.monotonic() + 120
                while not (taken := received.test(status=status))[0]:
                    if time.monotonic() > deadline:
                        return False, "rank 0 never received the application's message"
                    time.sleep(0.01)
                source, tag, message = status.Get_source(), status.Get_tag(), taken[1]
                return (
                    (source, tag, message) == (size - 1, 7, ("application", size - 1)),
                    f"from rank {source}, tag {tag}: {message!r}",
                )

            check("L/any-source-receive-takes-the-applications-message", applications_message)
    else:
        # Blocked in work of its own until the members are done: they need nothing from it.
        def blocked():
            deadline = time.monotonic() + 120
            while not done.exists():
                if time.monotonic() > deadline:
                    return False, "the members never finished L while this rank was away"
                time.sleep(0.01)
            return True, done.read_text()

        check("L/non-member-blocked-meanwhile", blocked)
        MPI.COMM_WORLD.send(("application", rank), dest=0, tag=7)

    mine = "P" if rank in local["P"] else "Q"

    def disjoint():
        members = local[mine]
        made = [sets.add_process_set(members, members_only=True) for _ in range(2)]
        sums = [ps.allreduce(data(rank, 6, i), op=ringplug.Sum) for i, ps in enumerate(made)]
        wanted = [sum(data(r, 6, i) for r in members) for i in range(2)]
        for ps in made:
            sets.remove_process_set(ps, members_only=True)
        report["PQ/ids"] = [ps.process_set_id for ps in made]
        return all(np.allclose(a, b) for a, b in zip(sums, wanted, strict=True)), ""

    check("PQ/disjoint-sets-at-once", disjoint)
    ids = ringplug.allgather_object(report.pop("PQ/ids", None))
    text = {k: "[" + ",".join(map(str, local[k])) + "]" for k in ("P", "Q")}
    check(
        "PQ/ids-unique-and-counted",
        lambda: (
            all(
                ids[r] == [text["P" if r in local["P"] else "Q"] + n for n in ("#0", "#1")]
                for r in range(size)
            ),
            str(ids),
        ),
    )

    # Bad input: the caller is not in its ranks (refused on it alone, at once: the members it
    # named never hear of it); duplicates (refused on every member it named, alike).
    check(
        "local-bad/caller-not-in-its-ranks",
        lambda: sets.add_process_set([r for r in range(size) if r != rank], members_only=True),
        raises(ValueError, f"rank {rank} passed", f"which does not name rank {rank}"),
    )
    if rank in (0, 1):
        check(
            "local-bad/duplicate-ranks",
            lambda: sets.add_process_set([0, 1, 1] if rank == 0 else [0, 1], members_only=True),
            raises(ValueError, "process set [0,1]#", "rank 0 passed rank 1 more than once"),
        )
    if rank in local["P"]:
        pair = sets.add_process_set(local["P"], members_only=True)
        check(
            "local-bad/removed-by-the-world",
            lambda: sets.remove_process_set(pair),
            raises(ValueError, "made by its members only", "members_only=True"),
        )
        sets.remove_process_set(pair, members_only=True)


def main(outdir: str) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    report: dict[str, dict] = {}

    def check(name, call, judge=None):
        try:
            if judge is not None:
                ok, detail = judge(call)
            else:
                result = call()
                ok, detail = (
                    (result[0], str(result[1]))
                    if isinstance(result, tuple)
                    else (
                        bool(result),
                        "",
                    )
                )
        except Exception:  # noqa: BLE001 - recorded, and the job goes on
            ok, detail = False, traceback.format_exc()[-2000:]
        report[name] = {"ok": bool(ok), "detail": detail}

    quiet = MPI.COMM_WORLD.Dup()
    wanted = set_ranks(size)
    made = {label: sets.add_process_set(members) for label, members in wanted.items()}
    ids = ringplug.allgather_object([made[label].process_set_id for label in "ABC"])
    check("ids-agree", lambda: all(i == [1, 2, 3] for i in ids))

    for label, ps in made.items():
        if ps.included():
            run_kinds(check, ps, label, rank)
        else:
            check(
                f"{label}/refused-on-a-non-member",
                lambda ps=ps: ps.allreduce(np.ones(3)),
                raises(
                    ValueError,
                    f"rank {rank} is not in this set",
                    f"process set {ps.process_set_id}",
                ),
            )
    # Counted one set at a time, while the other ranks wait outside every engine.
    for label, ps in made.items():
        quiet_barrier(quiet)
        if ps.included():
            check(f"{label}/negotiation-grows-with-the-set", lambda ps=ps: counted(ps))
    quiet_barrier(quiet)
    pair = made["C"]
    if pair.included():

        def vector(r):
            return data(r, 17, 11) * (1.0 if r == 0 else -0.5) + np.eye(17)[r % 17]

        mine, first, second = vector(rank), vector(0), vector(size - 1)
        check(
            "C/adasum",
            lambda: np.allclose(pair.adasum(mine, name="ada"), adasum_pair(first, second)),
        )

    # Every set this rank is in, and the world, with work in flight at once under the same
    # name (names are per set); waited for in the reverse order.
    def overlapping():
        count = 1 << 19
        own = data(rank, count, 12).astype(np.float32)
        handles = [(None, ringplug.allreduce_async(own, op=ringplug.Sum, name="overlap"))]
        handles += [
            (ps, ps.allreduce_async(own, op=ringplug.Sum, name="overlap"))
            for ps in made.values()
            if ps.included()
        ]
        for ps, handle in reversed(handles):
            members = range(size) if ps is None else ps.ranks
            expected = sum(data(r, count, 12).astype(np.float32) for r in members)
            if not np.allclose(handle.wait(), expected, rtol=1e-5):
                return False, f"wrong sum on {ps}"
        return True, f"{len(handles)} in flight"

    check("overlapping-sets-in-flight", overlapping)
    members_only(check, report, rank, size, Path(outdir))

    # Bad input: the same error on every rank, and nobody left waiting.
    check(
        "bad/duplicate-ranks",
        lambda: sets.add_process_set([0, 0, 1]),
        raises(ValueError, "rank 0 passed rank 0 more than once", "process set 4"),
    )
    check(
        "bad/rank-outside-the-world",
        lambda: sets.add_process_set([0, size] if rank == 0 else [0, 1]),
        raises(ValueError, f"rank 0 passed rank {size}, outside the world of {size}"),
    )
    check(
        "bad/not-a-list-of-ranks",
        lambda: sets.add_process_set("ab" if rank == 1 else [0, 1]),
        raises(ValueError, "rank 1 passed 'ab', which is not a list of ranks"),
    )
    check(
        "bad/ranks-disagree",
        lambda: sets.add_process_set([0, 1] if rank == 0 else [0, 2]),
        raises(ringplug.MismatchError, "rank 0 passed [0, 1]", "passed [0, 2]"),
    )

    def ids_disagree():
        # As if rank 0 alone had retired the next id (sets removed by their members only).
        next_id = sets._sets.free_id()
        if rank == 0:
            sets._sets.retired.add(next_id)
        try:
            return sets.add_process_set([0, 1])
        finally:
            sets._sets.retired.discard(next_id)

    check(
        "bad/ids-disagree",
        ids_disagree,
        raises(ringplug.MismatchError, "different ids", "rank 0: 5; rank 1: 4"),
    )
    members_b = made["B"].ranks
    if made["B"].included():
        shape = 3 if rank == members_b[0] else 4
        check(
            "B/mismatch-names-tensor-and-set",
            lambda: made["B"].allreduce(np.ones(shape), name="w"),
            raises(
                ringplug.MismatchError,
                "'w'",
                f"rank {members_b[0]} submitted",
                f"rank {members_b[1]} submitted",
                f"process set 2 (world ranks {members_b[0]}, {members_b[1]})",
            ),
        )
        if rank == members_b[0]:
            check(
                "B/barrier-timeout-names-world-rank",
                lambda: made["B"].barrier(name="lonely", timeout=2.0),
                raises(ringplug.BarrierTimeoutError, f"rank(s) {members_b[1]}, which never"),
            )
        # The other member never calls "lonely": it learns the outcome from the world.
        verdicts = ringplug.allgather_object(
            report.get("B/barrier-timeout-names-world-rank", {}).get("ok")
        )
        if rank == members_b[1]:
            report["B/barrier-timeout-names-world-rank"] = {
                "ok": verdicts[members_b[0]] is True,
                "detail": "its peer's verdict",
            }
    else:
        ringplug.allgather_object(None)

    # Removing C while its rank 0 has a collective in flight on it: refused everywhere.
    late = pair.allreduce_async(np.ones(2), op=ringplug.Sum, name="late") if rank == 0 else None
    check(
        "bad/remove-with-work-pending",
        lambda: sets.remove_process_set(pair),
        raises(ringplug.RingplugError, "Cannot remove process set 3", "rank 0: 1 ('late')"),
    )
    if rank == size - 1:
        pair.allreduce(np.ones(2), op=ringplug.Sum, name="late")
    if late is not None:
        late.wait()
    sets.remove_process_set(pair)
    check(
        "bad/removed-set-refused",
        lambda: pair.allreduce(np.ones(2)),
        raises(ringplug.RingplugError, "process set 3", "was removed"),
    )
    sets.remove_process_set(made["A"])
    sets.remove_process_set(made["B"])
    check(
        "world-still-works",
        lambda: (
            np.array_equal(ringplug.allreduce(np.ones(2), op=ringplug.Sum), [size, size])
            and sets.all_process_sets() == []
        ),
    )
    Path(outdir, f"sets-{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
