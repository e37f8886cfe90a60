"""Multi-rank worker for the engine: async submission, negotiation, fusion, join, stalls.

``python engine.py SCENARIO OUTDIR``; each rank writes OUTDIR/<scenario>-<rank>.json.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

import ringplug
import ringplug.core.runtime


def tensor(name_index: int, rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([name_index, rank, step])
    return rng.integers(-50, 50, 1 + name_index * 37).astype(np.float64)


def orders(rank: int) -> dict:
    """Forty named tensors submitted in a different order on every rank, three steps."""
    size = ringplug.size()
    engine = ringplug.core.runtime.engine()
    names = list(range(40))
    results = {"ok": True, "bad": []}
    for step in range(3):
        order = list(np.random.default_rng([rank, step]).permutation(names))
        handles = {}
        for i in order:
            buf = tensor(i, rank, step)
            if i % 5:  # in place
                handle = ringplug.allreduce_async(buf, op="sum", name=f"t{i}", out=buf)
            else:  # out of place, with scaling that cancels out
                handle = ringplug.allreduce_async(
                    buf, op="sum", name=f"t{i}", prescale_factor=0.5, postscale_factor=2.0
                )
            handles[i] = (buf, handle)
        for i, (buf, handle) in handles.items():
            result = handle.wait()
            expected = sum(tensor(i, r, step) for r in range(size))
            in_place_ok = (result is buf) == bool(i % 5)
            untouched = i % 5 or np.array_equal(buf, tensor(i, rank, step))
            if not (in_place_ok and untouched and np.array_equal(result, expected)):
                results["ok"] = False
                results["bad"].append([step, i])
    grouped = ringplug.grouped_allreduce(
        [np.full(3, rank + 1.0), np.full(2, 2.0 * rank)], op="sum", name="group"
    )
    results["grouped"] = [g.tolist() for g in grouped]
    results["cache_slots"] = len(engine.cycle.cache.slots)
    results["collectives"] = engine.collectives_run
    results["cycles"] = engine.counters.cycles_run
    return results


def plain(rank: int) -> dict:
    """Bursts of asynchronous allreduces of plain arrays (C-contiguous, a native type, in
    place or into a new array) of every storage kind, each rank submitting in its own order,
    three steps: every result (sums exact, means within bfloat16's rounding), dtype, shape
    and in-place identity, and every input left alone when the result is new."""
    import ml_dtypes

    size = ringplug.size()
    kinds = ["float32", "float64", "float16", "bfloat16", "int32", "int8", "bool"]
    shapes = [(), (7,), (3, 5), (2, 3, 4)]
    forms = [(k, s, fresh) for k in kinds for s in shapes for fresh in (False, True)]

    def values(index: int, who: int, step: int) -> np.ndarray:
        kind, shape, _ = forms[index]
        raw = np.random.default_rng([index, who, step]).integers(0, 4, shape)
        dtype = ml_dtypes.bfloat16 if kind == "bfloat16" else np.dtype(kind)
        return np.asarray(raw > 1 if kind == "bool" else raw.astype(dtype))

    bad = []
    for step in range(3):
        order = np.random.default_rng([rank, step, 7]).permutation(len(forms))
        handles = {}
        for index in order:
            kind, _, fresh = forms[index]
            array = values(index, rank, step)
            op = "sum" if kind in ("int32", "int8", "bool") or fresh else "average"
            out = None if fresh else array
            handles[index] = (
                array,
                ringplug.allreduce_async(array, op=op, out=out, name=f"plain{index}"),
            )
        for index, (array, handle) in handles.items():
            kind, shape, fresh = forms[index]
            result = handle.wait()
            every = [values(index, who, step) for who in range(size)]
            if kind == "bool":
                expected = np.logical_or.reduce(every)
            else:  # sums of small integers are exact in every type; means within rounding
                expected = sum(e.astype(np.float64) for e in every)
            averaged = kind not in ("int32", "int8", "bool") and not fresh
            if averaged:
                expected = expected / size
            got, want = result.astype(np.float64), np.asarray(expected, np.float64)
            ok = (
                result.shape == shape
                and result.dtype == array.dtype
                and (result is not array) == fresh
                and (np.allclose(got, want, rtol=1 / 64) if averaged else np.array_equal(got, want))
                and (not fresh or np.array_equal(array, values(index, rank, step)))
            )
            if not ok:
                bad.append([step, kind, list(shape), fresh])
    return {"bad": bad, "forms": len(forms)}


def duplicate(rank: int) -> dict:
    first = ringplug.allreduce_async(np.ones(4), name="dup")
    try:
        ringplug.allreduce_async(np.ones(4), name="dup")
        raised = None
    except ValueError as exc:
        raised = str(exc)
    first.wait()
    return {"raised": raised}


def mismatch(rank: int) -> dict:
    handle = ringplug.allreduce_async(np.ones((3, 2 + rank), np.float32), name="layer1/kernel")
    other = ringplug.allreduce_async(np.ones(5, np.float64 if rank else np.float32), name="bias")
    seen = {}
    for label, h in (("kernel", handle), ("bias", other)):
        try:
            h.wait()
            seen[label] = None
        except ringplug.MismatchError as exc:
            seen[label] = str(exc)
    return seen


def join(rank: int) -> dict:
    """Rank r has r + 1 batches; the others join when they run out."""
    size = ringplug.size()
    sums, mins, means = [], [], []
    for _batch in range(rank + 1):
        sums.append(ringplug.allreduce(np.full(3, rank + 1.0), op="sum", name="s").tolist())
        mins.append(ringplug.allreduce(np.full(2, rank + 1.0), op="min", name="m").tolist())
        means.append(ringplug.allreduce(np.full(2, 6.0), op="average", name="a").tolist())
    last = ringplug.join()
    after = ringplug.allreduce(np.ones(2), op="sum").tolist()  # everyone is back in
    return {"sums": sums, "mins": mins, "means": means, "last": last, "after": after, "size": size}


def stall(rank: int) -> dict:
    # Ranks submit different names: each waits for a tensor the other never sends.
    handle = ringplug.allreduce_async(np.ones(4), name=f"only-on-rank-{rank}")
    try:
        handle.wait()
        return {"error": None}
    except ringplug.StallError as exc:
        return {"error": str(exc), "type": type(exc).__name__}


def shutdown(rank: int) -> dict:
    """Shut down with work in flight: finished results stay, the unmatched one fails."""
    done = ringplug.allreduce_async(np.full(4, rank + 1.0), op="sum", name="finished")
    kept = done.wait().tolist()
    lonely = ringplug.allreduce_async(np.ones(4), name="never-matched") if rank == 0 else None
    # Rank 0 shuts down first, so that its unmatched call meets its own shutdown. Were rank
    # 1's shutdown to reach rank 0's engine first, rank 1 would have left while rank 0 still
    # waited in a collective: a rank that left early, which fails the job (another test).
    said_done = Path(sys.argv[2]) / "shutdown-rank-0-done"
    if rank == 1:
        deadline = time.monotonic() + 60
        while not said_done.exists() and time.monotonic() < deadline:
            threading.Event().wait(0.01)  # polls a condition, under a deadline
    ringplug.shutdown()
    if rank == 0:
        said_done.touch()
    outcome = None
    if lonely is not None:
        try:
            lonely.wait(timeout=30)
        except ringplug.RingplugError as exc:
            outcome = str(exc)
    return {
        "kept": kept,
        "lonely": outcome,
        "done_still": done.wait().tolist(),
        "initialized": ringplug.is_initialized(),
    }


def idle_cpu(rank: int) -> dict:
    """Rank 0 waits about a second for rank 1; how much CPU does the wait cost rank 0?"""
    ringplug.barrier()
    if rank == 1:
        threading.Event().wait(1.0)  # the late rank (the scenario, not a synchronisation)
    cpu, wall = time.process_time(), time.perf_counter()
    ringplug.allreduce(np.ones(8), name="late")
    return {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}


def callers(rank: int) -> dict:
    """Synchronous calls run their cycles on the caller's thread when the engine is free;
    several user threads calling at once still each get their own, correct result."""
    engine = ringplug.core.runtime.engine()
    ringplug.barrier()
    before = engine.counters.cycles_by_callers
    size = ringplug.size()
    wrong = []
    for step in range(40):
        got = ringplug.allreduce(np.full(16, float(rank + step)), op=ringplug.Sum, name="sync")
        if not np.all(got == sum(r + step for r in range(size))):
            wrong.append(("sync", step))
    driven = engine.counters.cycles_by_callers - before

    def worker(index: int) -> None:
        for step in range(15):
            value = float(rank * 100 + index * 10 + step)
            got = ringplug.allreduce(np.full(8, value), op=ringplug.Sum, name=f"t{index}.{step}")
            expected = sum(r * 100 + index * 10 + step for r in range(size))
            if not np.all(got == expected):
                wrong.append((index, step))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    alive = [t.name for t in threads if t.is_alive()]
    return {"wrong": wrong, "driven": driven, "alive": alive}


def timeline(rank: int) -> dict:
    for _step in range(3):
        handles = [
            ringplug.allreduce_async(np.ones(1000 * (i + 1)), name=f"grad{i}") for i in range(4)
        ]
        for h in handles:
            h.wait()
        ringplug.broadcast(np.ones(3), 0, name="params")
    ringplug.stop_timeline()
    return {}


def eager(rank: int) -> dict:
    """Small allreduces named before (given names, and unnamed ones of a signature seen
    before) travel inside the negotiation message; each rank reduces them itself."""
    size = ringplug.size()
    engine = ringplug.core.runtime.engine()
    report: dict = {"cases": {}, "digests": {}}
    rng = np.random.default_rng(1234)
    inputs = {r: rng.standard_normal(1000) for r in range(size)}  # the same on every rank
    cases = [
        ("float32", "sum", 1.0, 1.0),
        ("float64", "average", 1.0, 1.0),
        ("float32", "sum", 0.25, 3.0),
        ("float16", "sum", 1.0, 1.0),
        ("bfloat16", "max", 1.0, 1.0),
        ("float64", "min", 1.0, 1.0),
        ("int32", "sum", 1.0, 1.0),
        ("int64", "product", 1.0, 1.0),
        ("uint8", "max", 1.0, 1.0),
        ("bool", "sum", 1.0, 1.0),
    ]
    for named in (True, False):
        for dtype, op, pre, post in cases:
            values = [inputs[r] * 3 for r in range(size)]
            if dtype == "bfloat16":
                mine = np.asarray(values[rank], np.float32).view(np.uint32) >> 16
                send, kwargs = mine.astype(np.uint16), {"dtype": "bfloat16"}
                reference = [
                    (np.asarray(v, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
                    for v in values
                ]
            elif dtype == "bool":
                send, kwargs = values[rank] > 0, {}
                reference = [v > 0 for v in values]
            elif dtype == "int64":
                send, kwargs = (values[rank] > 0).astype(np.int64) + 1, {}
                reference = [(v > 0).astype(np.int64) + 1 for v in values]
            else:
                send, kwargs = values[rank].astype(dtype), {}
                reference = [v.astype(dtype).astype(np.float64) for v in values]
            name = f"{dtype}-{op}-{pre}" if named else None
            paths, results = [], []
            before = engine.counters.fast_by_callers
            for _step in range(3):  # the first is negotiated as new, the others eager
                result = ringplug.allreduce(
                    send, op=op, prescale_factor=pre, postscale_factor=post, name=name, **kwargs
                )
                paths.append(engine.transport.last_path)
                results.append(result)
            combine = {
                "sum": np.add,
                "average": np.add,
                "max": np.maximum,
                "min": np.minimum,
                "product": np.multiply,
            }[op]
            if dtype == "bool":  # Sum of bools is a logical or
                expected = functools.reduce(np.logical_or, reference).astype(np.float64)
            else:
                expected = functools.reduce(combine, [np.asarray(r) * pre for r in reference])
                expected = expected * post / (size if op == "average" else 1)
            got = results[-1]
            if dtype == "bfloat16":
                got = (got.astype(np.uint32) << 16).view(np.float32)
            tolerance = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-5}.get(dtype, 1e-12)
            key = f"{'named' if named else 'unnamed'}/{dtype}/{op}/{pre}"
            report["cases"][key] = {
                "paths": paths,
                "now": engine.counters.fast_by_callers - before,  # fast cycles run by the caller
                "ok": bool(
                    np.allclose(
                        np.asarray(got, np.float64), expected, rtol=tolerance, atol=tolerance
                    )
                    and np.array_equal(results[1], results[2])
                ),
            }
            report["digests"][key] = hashlib.sha256(np.ascontiguousarray(got).tobytes()).hexdigest()
    # In place and into a new array, as the usual path does them.
    before = engine.counters.fast_by_callers
    report["in_place_ok"], report["fresh_ok"] = [], []
    buf = np.empty((2, 3), np.float32)
    total = size * (size + 1) / 2
    for _step in range(3):
        buf[...] = rank + 1
        got = ringplug.allreduce(buf, op="sum", out=buf, name="in-place")
        report["in_place_ok"].append(got is buf and bool(np.all(buf == total)))
        source = np.full((2, 3), rank + 1.0)
        fresh = ringplug.allreduce(source, postscale_factor=2.0, name="fresh")  # Average
        report["fresh_ok"].append(
            fresh is not source
            and bool(np.all(source == rank + 1) and np.allclose(fresh, 2 * total / size))
        )
    report["in_place_now"] = engine.counters.fast_by_callers - before
    # A grouped allreduce (as torch.distributed's calls are), in place and not.
    grouped_paths, grouped_ok = [], True
    for _step in range(3):
        arrays = [np.full(3, rank + 1.0), np.arange(5, dtype=np.float64) * rank]
        results = ringplug.grouped_allreduce(arrays, op="sum", name="grouped")
        grouped_paths.append(engine.transport.last_path)
        ringplug.grouped_allreduce(arrays, op="max", out=arrays)
        grouped_ok &= [r.tolist() for r in results] == [
            [size * (size + 1) / 2] * 3,
            (np.arange(5) * size * (size - 1) / 2).tolist(),
        ] and [a.tolist() for a in arrays] == [
            [float(size)] * 3,
            (np.arange(5.0) * (size - 1)).tolist(),
        ]
    report["grouped"] = {"paths": grouped_paths, "ok": bool(grouped_ok)}
    # A name whose shape changes: its slot is given the new form, and the message of each
    # form carries as many bytes as it has, three times over (the fast path keeps a
    # slot's message form: a stale one would misread the data).
    report["reshaped"] = []
    for length in (3, 3, 3, 5, 5, 5, 3, 3, 3):
        got = ringplug.allreduce(np.full(length, rank + length, np.float64), "sum", name="shape")
        expected = sum(r + length for r in range(size))
        ok = got.shape == (length,) and bool(np.all(got == expected))
        if engine.transport.last_path == "eager":  # the fast path ran the slot's prepared cycle
            prepared = engine.cycle._lones[engine.cycle.cache.by_name["shape"]]
            ok &= prepared.nbytes == 8 * length  # what its message says it carries
            ok &= prepared.plan.responses[0].signature.shape == (length,)
        report["reshaped"].append([engine.transport.last_path, ok])
    # Larger than RINGPLUG_EAGER_THRESHOLD: the usual path.
    big = np.ones((64 << 10) // 4 + 1, np.float32)
    for _ in range(2):
        ringplug.allreduce(big, op="sum", name="big", out=big)
    report["big_path"] = engine.transport.last_path
    report["big_ok"] = bool(np.all(big == size * size))
    # More small requests at once than one message carries: some eager, the rest fused.
    for step in range(3):
        handles = [
            ringplug.allreduce_async(
                np.full(1024, float(rank + i + step), np.float32), op="sum", name=f"many{i}"
            )
            for i in range(40)
        ]
        sums = [handle.wait() for handle in handles]
    report["many_ok"] = all(
        np.all(total == sum(r + i + 2 for r in range(size))) for i, total in enumerate(sums)
    )
    # Unnamed calls of two signatures seen before, different on two ranks: a mismatch.
    for shape in ((3,), (4,)):
        ringplug.allreduce(np.ones(shape), op="sum")
    try:
        ringplug.allreduce(np.ones((3,) if rank == 0 else (4,)), op="sum")
        report["mismatch"] = ""
    except ringplug.RingplugError as exc:
        report["mismatch"] = str(exc)
    report["after"] = ringplug.allreduce(np.ones(2), op="sum").tolist()
    return report


def express(rank: int) -> dict:
    """Synchronous calls of forms agreed before, with nothing else in flight, run their
    cycle at once on the caller's thread; when a peer has more in flight, or a call does
    not match, the cycle takes the full negotiation and ends as it always did."""
    size = ringplug.size()
    engine = ringplug.core.runtime.engine()
    report: dict = {}
    ringplug.allreduce(np.ones(4), op="sum", name="sync")  # agreed from now on
    ringplug.barrier()
    before = engine.counters.fast_cycles
    sums = [
        ringplug.allreduce(np.full(4, rank + step), op="sum", name="sync")[0] for step in range(20)
    ]
    report["fast_cycles"] = engine.counters.fast_cycles - before
    report["sums_ok"] = sums == [sum(r + step for r in range(size)) for step in range(20)]
    # Rank 1 has another request in flight, which the others have not submitted yet: its
    # message differs, and the others' fast path falls back to the full negotiation.
    extra = None
    if rank == 1:
        extra = ringplug.allreduce_async(np.full(3, 5.0), op="sum", name="extra")
    before = engine.counters.fast_cycles
    got = ringplug.allreduce(np.full(4, float(rank)), op="sum", name="sync")
    report["fallback_ok"] = bool(np.all(got == sum(range(size))))
    report["fast_in_fallback"] = engine.counters.fast_cycles - before
    if extra is None:
        extra = ringplug.allreduce_async(np.full(3, 5.0), op="sum", name="extra")
    report["extra_ok"] = bool(np.all(extra.wait() == 5.0 * size))
    # Above the eager size: the fast cycle runs the collective on the caller's thread.
    big = np.full((64 << 10) // 8 + 1, float(rank))
    before = engine.counters.fast_by_callers
    for _ in range(3):
        ringplug.allreduce(big, op="sum", name="big-sync", out=big)
        big[:] = rank
    report["big_ok"] = bool(
        np.all(ringplug.allreduce(big, op="sum", name="big-sync") == sum(range(size)))
    )
    report["big_now"] = engine.counters.fast_by_callers - before  # fast cycles by the caller
    # A form agreed before, now with another shape on rank 0: a mismatch on every rank.
    try:
        ringplug.allreduce(np.ones(5 if rank == 0 else 4), op="sum", name="sync")
        report["mismatch"] = ""
    except ringplug.RingplugError as exc:
        report["mismatch"] = f"{type(exc).__name__}: {exc}"
    report["after"] = ringplug.allreduce(np.ones(2), op="sum", name="sync-after").tolist()
    return report


def main(scenario: str, outdir: Path) -> None:
    ringplug.init()
    rank = ringplug.rank()
    result = globals()[scenario](rank)
    (outdir / f"{scenario}-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
