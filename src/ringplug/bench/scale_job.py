"""The ranks of `ringplug-bench scale` (started by it under ringrun; not a command of its own).

``python scale_job.py counts OUTDIR STEPS CPU_STEPS``: every rank runs a training-like step
(8 named 4 KiB allreduces submitted together, then waited for), a 1 MiB and a 16 MiB
allreduce, and the small step again with 1 and with 32 tensors, ``STEPS`` times each after
a warm-up (the small steps ``CPU_STEPS`` times), and writes OUTDIR/counts-<rank>.json: per
step, the engine's own counts (`Engine.traffic`: messages and bytes by purpose, MPI
collectives called), its cycles, and the CPU time of its thread and of the whole process.
An MPI profiling library preloaded into the rank (tests/pmpi/count_sends.c) writes its own
count of the sends of all phases (one window) to OUTDIR/sends-<rank>.txt, and the report has
the engine's counts over the same window.

``python scale_job.py calls OUTDIR STEPS``: every rank runs the small steps (1, 8 and 32
tensors) counting the function calls each step makes outside the engine's waits
(:class:`CallCounter`), and writes OUTDIR/calls-<rank>.json.

``python scale_job.py sets OUTDIR STEPS K``: a process set of K ranks spread over the world
runs the same 8 x 4 KiB step and 1 MiB allreduce on its own engine, counted the same way
(OUTDIR/sets-<rank>.json on its members), while the others wait outside every engine.

``python scale_job.py bed OUTDIR BUDGET``: ringplug, MPI's own Allreduce (mpi4py) and torch
gloo side by side on 4 KiB, 1 MiB and 64 MiB of float32 and on ResNet-50's gradients (one
allreduce per parameter), timed as `ringplug-bench allreduce` times them; rank 0 writes
OUTDIR/bed.json with the medians, and what ringplug's engine sent per call.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# The small step's tensor counts in the counts job (the sets job runs 8 only).
SMALL_STEPS = (1, 8, 32)
SMALL_PHASES = tuple(f"{tensors}x4K" for tensors in SMALL_STEPS)
# The parts of a step's calls (`CallCounter`): inside the agreement rounds
# (`Exchange.send_and_receive`), inside recursive doubling, and everything else.
AGREEMENT, DOUBLING, REST = "agreement", "doubling", "rest"
PARTS = (AGREEMENT, DOUBLING, REST)
BED_SIZES = {"4K": 4 << 10, "1M": 1 << 20, "64M": 64 << 20}
RESNET50 = "resnet50"


def _engine():
    import ringplug.core.runtime

    return ringplug.core.runtime.engine()


def _thread_cpu(thread) -> float:
    """CPU seconds `thread` (a running threading.Thread) has used so far."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class WaitClock:
    """CPU seconds every thread spent inside the engine's waits (`Waiter.wait`: polling MPI
    until peers answer), so that the CPU of a cycle's own work can be told from waiting:
    on a machine with fewer cores than ranks the waits are most of it."""

    def __init__(self, waiter) -> None:
        self.seconds = 0.0
        self._wait = waiter.wait
        waiter.wait = self._timed

    def _timed(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return self._wait(*args, **kwargs)
        finally:
            self.seconds += time.thread_time() - start


def _counted(run: Callable[[], object], calls: int, clock: WaitClock | None = None) -> dict:
    """What the engine did per call of `run`, over `calls` calls."""
    from ringplug.core.transport.traffic import difference

    engine = _engine()
    waited = clock.seconds if clock else 0.0
    before = engine.traffic.snapshot()
    cycles, by_callers = engine.counters.cycles_run, engine.counters.cycles_by_callers
    thread = engine.scheduler.thread
    thread_cpu, process_cpu, wall = _thread_cpu(thread), time.process_time(), time.perf_counter()
    for _ in range(calls):
        run()
    thread_cpu = _thread_cpu(thread) - thread_cpu
    process_cpu = time.process_time() - process_cpu
    wall = time.perf_counter() - wall
    waited = (clock.seconds - waited) if clock else 0.0
    counts = difference(engine.traffic.snapshot(), before)
    return {
        "calls": calls,
        "cycles": (engine.counters.cycles_run - cycles) / calls,
        "cycles_by_callers": (engine.counters.cycles_by_callers - by_callers) / calls,
        "messages": {k: v / calls for k, v in counts["messages"].items()},
        "bytes": {k: v / calls for k, v in counts["bytes"].items()},
        "collectives": {k: v / calls for k, v in counts["collectives"].items()},
        "engine_thread_cpu_s": thread_cpu / calls,
        "process_cpu_s": process_cpu / calls,
        "wait_cpu_s": waited / calls,  # of the process's: inside the engine's waits
        "wall_s": wall / calls,
    }


def counts(outdir: Path, steps: int, cpu_steps: int) -> None:
    from mpi4py import MPI

    import ringplug
    from ringplug.core.transport.traffic import difference

    ringplug.init()
    rank = ringplug.rank()
    runs = _phases(large=True)
    clock = WaitClock(_engine().waiter)
    report: dict = {"rank": rank, "size": ringplug.size(), "steps": steps, "phases": {}}
    for phase, run in runs.items():
        # The names are agreed (cached) after 2 steps; the small steps, timed for their
        # CPU, warm up longer.
        for _ in range(2 if phase not in SMALL_PHASES else 10):
            run()
    ringplug.barrier()
    # One window of the profiling library around every phase (its counts are the window's
    # total), checked against the engine's counts over the same window.
    engine = _engine()
    before = engine.traffic.snapshot()
    os.environ["PMPI_COUNT_DIR"] = str(outdir)  # read by the library at Pcontrol(0)
    MPI.Pcontrol(1)
    for phase, run in runs.items():
        calls = cpu_steps if phase in SMALL_PHASES else steps
        report["phases"][phase] = _counted(run, calls, clock)
        report["phases"][phase]["path"] = engine.transport.last_path
        ringplug.barrier()
    MPI.Pcontrol(0)
    window = difference(engine.traffic.snapshot(), before)
    report["window"] = {"messages": window["messages"], "bytes": window["bytes"]}
    (outdir / f"counts-{rank}.json").write_text(json.dumps(report))
    ringplug.shutdown()


def _phases(large: bool) -> dict[str, Callable[[], object]]:
    """The counted phases, each one step: 8 named 4 KiB allreduces in flight at once, one
    1 MiB allreduce and (with `large`) one 16 MiB allreduce, on the current engine. With
    `large` the small step also comes with 1 and with 32 tensors (`SMALL_STEPS`), so that the
    CPU model can tell what a cycle costs from what each tensor in it costs."""
    import ringplug

    medium = np.zeros(1 << 18, np.float32)
    big = np.zeros(1 << 22, np.float32)
    runs: dict[str, Callable[[], object]] = {"8x4K": _small_step(8)}
    runs["1M"] = lambda: ringplug.allreduce(medium, op=ringplug.Sum, out=medium, name="1M")
    if large:
        runs["16M"] = lambda: ringplug.allreduce(big, op=ringplug.Sum, out=big, name="16M")
        for tensors in SMALL_STEPS:
            runs.setdefault(f"{tensors}x4K", _small_step(tensors))
    return runs


def _small_step(tensors: int) -> Callable[[], None]:
    """A step of `tensors` named 4 KiB allreduces submitted together, then waited for."""
    import ringplug

    grads = [np.zeros(1024, np.float32) for _ in range(tensors)]

    def step() -> None:
        handles = [
            ringplug.allreduce_async(g, op=ringplug.Sum, out=g, name=f"grad{tensors}.{i}")
            for i, g in enumerate(grads)
        ]
        for handle in handles:
            ringplug.synchronize(handle)

    return step


class CallCounter:
    """Counts the function calls (Python's and C's: builtins, numpy's, mpi4py's) every
    thread makes while `counting`, by part of the engine (`PARTS`: the calls inside
    agreement, inside recursive doubling, and the rest), through a profile function
    installed before `ringplug.init` starts the engine's thread.

    Inside the engine's waits (`Waiter.wait`) the tests of the wait count less what a test
    that finds nothing costs (the fewest calls any of its tests made), times the tests that
    did not end it: what is left is the work done on what arrived (receiving, taking in,
    sending the next round), not the polling, whose amount depends on how long the peers
    took. Unlike CPU time the count does not change
    when ranks share a core: it is what the step's code does; what one call costs is
    measured where each rank has a core."""

    def __init__(
        self, wait: Callable | None = None, parts: dict[Callable, str] | None = None
    ) -> None:
        """`wait`: the engine's wait (`Waiter.wait`); `parts`: function -> the part its
        calls count in (`PARTS`: `Exchange.send_and_receive` and `doubling.allreduce`)."""
        if wait is None or parts is None:
            from ringplug.core.engine.exchange import Exchange
            from ringplug.core.transport import doubling
            from ringplug.core.transport.waiting import Waiter

            wait = Waiter.wait
            parts = {Exchange.send_and_receive: AGREEMENT, doubling.allreduce: DOUBLING}
        self.counting = False
        self.calls: dict[str, int] = {}
        self._wait = wait.__code__
        self._parts = {function.__code__: part for function, part in parts.items()}
        # Per thread: parts, the (frame, part) entered; waits, for each Waiter.wait it is
        # in, its test's code and the calls of each of its tests that did not end it; test,
        # the frame of the test running, and pending, its calls so far.
        self._thread = threading.local()
        threading.setprofile(self._event)
        sys.setprofile(self._event)

    def _event(self, frame, event: str, arg) -> None:
        if not self.counting:
            return
        here = self._thread
        if not hasattr(here, "parts"):
            here.parts, here.waits, here.test, here.pending = [], [], None, 0
        if event == "call":
            part = self._parts.get(frame.f_code)
            if part is not None:
                here.parts.append((frame, part))
        waits = here.waits
        if not waits:  # outside the waits: every call counts
            if event == "call":
                if frame.f_code is self._wait:
                    waits.append((self._test_code(frame), []))
                else:
                    self._add(here, 1)
            elif event == "c_call":
                self._add(here, 1)
            elif event == "return":
                self._leave(here, frame)
            return
        test = here.test
        if event == "call":
            if frame.f_code is self._wait:
                waits.append((self._test_code(frame), []))
            elif (
                test is None and frame.f_code is waits[-1][0] and frame.f_back.f_code is self._wait
            ):
                here.test, here.pending = frame, 1  # a test of the wait begins
            elif test is not None:
                here.pending += 1
        elif event == "c_call" and test is not None:
            here.pending += 1
        elif event == "return":
            if frame is test:
                if arg:  # the test that ended the wait
                    self._add(here, here.pending)
                else:
                    waits[-1][1].append(here.pending)
                here.test = None
            elif frame.f_code is self._wait:
                _, missed = waits.pop()
                if missed:  # what the tests that did not end it did beyond polling
                    self._add(here, sum(missed) - len(missed) * min(missed))
            self._leave(here, frame)

    def _add(self, here, calls: int) -> None:
        part = here.parts[-1][1] if here.parts else REST
        self.calls[part] = self.calls.get(part, 0) + calls

    @staticmethod
    def _leave(here, frame) -> None:
        if here.parts and here.parts[-1][0] is frame:
            here.parts.pop()

    @staticmethod
    def _test_code(frame) -> object:
        """The code of the test a starting `Waiter.wait` will call (None for a C method:
        MPI's own Test, one call that does no work of the engine's)."""
        return getattr(frame.f_locals.get("done"), "__code__", None)

    def count(self, run: Callable[[], object]) -> dict[str, int]:
        """The calls of one call of `run`, by part."""
        self.calls = dict.fromkeys(PARTS, 0) | dict.fromkeys(self._parts.values(), 0)
        self.counting = True
        try:
            run()
        finally:
            self.counting = False
        return self.calls


def calls(outdir: Path, steps: int) -> None:
    """Every rank runs the small steps (1, 8 and 32 named 4 KiB allreduces) under a
    :class:`CallCounter` and writes OUTDIR/calls-<rank>.json: per step shape, the median
    over `steps` steps of the calls of each part, and the engine's cycles, messages and
    collectives per step over the same steps."""
    counter = CallCounter()
    import ringplug
    from ringplug.core.transport.traffic import difference

    ringplug.init()
    engine = _engine()
    report: dict = {"rank": ringplug.rank(), "size": ringplug.size(), "phases": {}}
    for tensors in SMALL_STEPS:
        run = _small_step(tensors)
        for _ in range(10):  # agreed (cached) names, warm caches
            run()
        ringplug.barrier()
        before, cycles = engine.traffic.snapshot(), engine.counters.cycles_run
        counted = [counter.count(run) for _ in range(steps)]
        traffic = difference(engine.traffic.snapshot(), before)
        report["phases"][f"{tensors}x4K"] = {
            "calls": {part: _median_int([c[part] for c in counted]) for part in PARTS},
            "cycles": (engine.counters.cycles_run - cycles) / steps,
            "messages": {k: v / steps for k, v in traffic["messages"].items()},
            "collectives": {k: v / steps for k, v in traffic["collectives"].items()},
        }
        ringplug.barrier()
    (outdir / f"calls-{ringplug.rank()}.json").write_text(json.dumps(report))
    ringplug.shutdown()


def _median_int(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2])


def sets(outdir: Path, steps: int, k: int) -> None:
    """A process set of `k` ranks spread over the world (every (p/k)-th rank) runs the
    8 x 4 KiB step and the 1 MiB allreduce on its own engine; each member writes
    OUTDIR/sets-<rank>.json with the set engine's counts per step and (preloaded) the
    profiling library's count of every send of the process over the same window. The
    ranks outside the set wait in a plain MPI barrier meanwhile, so that nothing else
    sends."""
    from mpi4py import MPI

    import ringplug
    from ringplug.core import runtime
    from ringplug.core.transport.traffic import difference

    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    fence = MPI.COMM_WORLD.Dup()  # the ranks meet here, outside every engine
    members = list(range(0, size, size // k))[:k]
    process_set = ringplug.add_process_set(members)
    if process_set.included():
        token = runtime.scope.set(process_set._engine)  # ringplug.* runs on the set
        runs = _phases(large=False)
        for run in runs.values():
            for _ in range(2):  # the names are agreed (cached) from here on
                run()
        ringplug.barrier()
        engine = _engine()
        world = runtime.world_engine()
        report: dict = {"rank": rank, "size": size, "set": members, "phases": {}}
        before, world_before = engine.traffic.snapshot(), world.traffic.snapshot()
        os.environ["PMPI_COUNT_DIR"] = str(outdir)
        MPI.Pcontrol(1)
        for phase, run in runs.items():
            report["phases"][phase] = _counted(run, steps)
            ringplug.barrier()
        MPI.Pcontrol(0)
        window = difference(engine.traffic.snapshot(), before)
        report["window"] = {"messages": window["messages"], "bytes": window["bytes"]}
        report["world_engine"] = difference(world.traffic.snapshot(), world_before)["messages"]
        runtime.scope.reset(token)
        (outdir / f"sets-{rank}.json").write_text(json.dumps(report))
    fence.Barrier()
    fence.Free()
    ringplug.remove_process_set(process_set)
    ringplug.shutdown()


def resnet50_buffers() -> list[np.ndarray]:
    """One float32 buffer per parameter of ResNet-50: torchvision's model where it is
    installed, else the shapes written out from its architecture (the same list)."""
    try:
        import torchvision

        model = torchvision.models.resnet50()
        shapes = [tuple(p.shape) for p in model.parameters()]
    except ImportError:
        from .fusion import resnet50_shapes

        shapes = [shape for _, shape in resnet50_shapes()]
    return [np.zeros(shape, np.float32) for shape in shapes]


def _bed_runners(
    name: str, buffers: list[np.ndarray], gloo: bool
) -> dict[str, Callable[[], object]]:
    """ringplug, MPI and (with `gloo`) torch gloo, each reducing every one of `buffers`."""
    from mpi4py import MPI

    import ringplug

    comm = MPI.COMM_WORLD
    names = [f"{name}.{i}" for i in range(len(buffers))]

    def ring() -> None:
        handles = [
            ringplug.allreduce_async(b, op=ringplug.Sum, out=b, name=n)
            for b, n in zip(buffers, names, strict=True)
        ]
        for handle in handles:
            ringplug.synchronize(handle)

    def mpi() -> None:
        MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, b, MPI.SUM) for b in buffers])

    runs = {"ringplug": ring, "mpi": mpi}
    if gloo:
        import torch
        import torch.distributed as dist

        tensors = [torch.from_numpy(b) for b in buffers]

        def torch_gloo() -> None:
            for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
                work.wait()

        runs["gloo"] = torch_gloo
    return runs


def bed(outdir: Path, budget: float) -> None:
    import ringplug

    from .allreduce import _gloo_group
    from .common import measure_side_by_side, median

    ringplug.init()
    try:
        _gloo_group()
        gloo = True
    except ImportError:  # without torch, ringplug and MPI only
        gloo = False
    from mpi4py import MPI

    cases = {label: [np.zeros(size // 4, np.float32)] for label, size in BED_SIZES.items()}
    cases[RESNET50] = resnet50_buffers()
    rows = []
    for label, buffers in cases.items():
        runs = _bed_runners(label, buffers, gloo)
        times = measure_side_by_side(runs, budget_s=budget, min_iters=3, max_iters=200, warmup=2)
        ringplug.barrier()
        engine = _counted(runs["ringplug"], 2)
        rows.append(
            {
                "case": label,
                "bytes": sum(b.nbytes for b in buffers),
                "tensors": len(buffers),
                "median_s": {impl: median(t) for impl, t in times.items()},
                "iterations": {impl: len(t) for impl, t in times.items()},
                "ringplug_engine": engine,
                "path": _engine().transport.last_path,
            }
        )
        ringplug.barrier()
    hosts = len(set(ringplug.allgather_object(MPI.Get_processor_name())))
    if ringplug.rank() == 0:
        document = {"ranks": ringplug.size(), "hosts": hosts, "rows": rows}
        (outdir / "bed.json").write_text(json.dumps(document))
    ringplug.barrier()
    if gloo:
        import torch.distributed as dist

        dist.destroy_process_group()
    ringplug.shutdown()


if __name__ == "__main__":
    mode, where, number = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if mode == "counts":
        counts(where, int(number), int(sys.argv[4]))
    elif mode == "calls":
        calls(where, int(number))
    elif mode == "sets":
        sets(where, int(number), int(sys.argv[4]))
    else:
        bed(where, float(number))
