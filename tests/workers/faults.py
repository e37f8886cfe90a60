"""Multi-rank worker for the fault-injection suite: one rank fails in a chosen way.

``python faults.py SCENARIO MARKER``; MARKER rides along in argv so the test can look for
leftover processes. Every rank runs a few warm-up collectives first; then the victim
(rank 1, rank 0 for the exit scenarios) prints ``FAULT <epoch seconds>`` and fails while
the others go on into collectives that need it. Faults are injected where the issue saw
them, from inside the victim (no timer, no outside signal racing the job):

  stop-negotiation  SIGSTOP as its engine starts a negotiation
  stop-ring         SIGSTOP inside the ring's exchange of a large allreduce
  stop-mpi          SIGSTOP inside MPI's Iallreduce of a small one (after posting it)
  stop-user         SIGSTOP in user code, between collectives
  stop-behind-idle  SIGSTOP in user code while rank 0 computes (its engine idle) and rank 2
                    waits in an allreduce: rank 0 hears of the cycle only through rank 1
  gil               stuck in C code that holds the GIL (libc sleep through ctypes.PyDLL)
  kill              SIGKILL
  engine-errors     a MemoryError while allgather runs, and a read-only `out=`; the job
                    goes on (every rank reports the errors, then reduces correctly)
  engine-dies       rank 1's engine fails for good while completing a fused batch of
                    allreduce_async calls (after their collective ran); every handle of
                    the batch fails there, and rank 1 leaves with sys.exit(4)
  engine-dies-in-ring  rank 1's engine fails for good as it starts a large allreduce
                    that the others already run on the ring; rank 1 leaves with
                    sys.exit(4)
  exit-3            rank 0 calls sys.exit(3) while the others wait in an allreduce
  exit-0-early      rank 1 calls os._exit(0) while the others wait in an allreduce
  nan               Max/Min with a NaN on each rank in turn, small and large
  secret            every rank checks that $RINGPLUG_TEST_SECRET (whose sha256 is argv[3])
                    arrived and appears in no process's command line
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import numpy as np

import ringplug
from ringplug.core import runtime
from ringplug.core.transport import ring

# Longer than any scenario's job lasts (the test's bound is 40 s).
JOB_BOUND_SECONDS = 60.0


def fault(label: str) -> None:
    print(f"FAULT {time.time():.3f} {label}", flush=True)


def freeze() -> NoReturn:
    """Stop this whole process here. SIGSTOP arrives asynchronously: the calling thread
    blocks so that it cannot get any further before the stop takes hold."""
    os.kill(os.getpid(), signal.SIGSTOP)
    threading.Event().wait()
    raise AssertionError("unreachable")


def warm_up(buf: np.ndarray) -> None:
    for _ in range(3):
        ringplug.allreduce(buf, op=ringplug.Sum, out=buf, name="warm-up")


def forever(buf: np.ndarray) -> None:
    while True:
        ringplug.allreduce(buf, op=ringplug.Sum, out=buf, name="stuck")


def main(scenario: str, extra: list[str]) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    engine = runtime.engine()
    small = np.ones(1000, np.float32)
    warm_up(small)
    if scenario == "stop-negotiation":
        if rank == 1:

            def frozen_exchange(cycle, own, pending):
                fault(f"negotiation of cycle {own.cycle}")
                freeze()

            engine.exchange.exchange = frozen_exchange
        forever(small)
    if scenario == "stop-ring":
        big = np.ones(1 << 20, np.float32)  # 4 MiB; RINGPLUG_RING_THRESHOLD puts it on the ring
        ringplug.allreduce(big, op=ringplug.Sum, out=big, name="big")
        assert engine.transport.last_path == "ring"
        if rank == 1:
            original = ring._exchange
            calls = []

            def frozen_ring_exchange(*args):
                calls.append(1)
                if len(calls) == 3:  # mid-way through the reduce-scatter
                    fault("ring exchange")
                    freeze()
                return original(*args)

            ring._exchange = frozen_ring_exchange
        forever(big)
    if scenario == "stop-mpi":
        if rank == 1:
            waiter = engine.waiter
            original = waiter.wait_requests

            def frozen_wait(requests, phase=""):
                if phase == "MPI Iallreduce" and waiter.what.startswith("allreduce 'stuck'"):
                    fault("mpi-allreduce")
                    freeze()
                return original(requests, phase)

            waiter.wait_requests = frozen_wait
        forever(small)
    if scenario == "stop-behind-idle":
        if rank == 1:
            fault("user code")
            freeze()
        if rank == 0:
            threading.Event().wait(JOB_BOUND_SECONDS)  # computing: the job ends before
            raise AssertionError("the job should have ended while rank 0 computed")
        forever(small)
    if scenario == "stop-user":
        if rank == 1:
            fault("user code")
            freeze()
        forever(small)
    if scenario == "stop-user-agreed":
        # The others' next calls are of a form agreed in the warm-up: each waits inside
        # the fast path of its own cycle's negotiation, on its own thread. Under load a
        # rank's warm-up calls may all have been run by the engine thread (it held the
        # turn): warm up until every rank has run one itself (bounded).
        flag = np.zeros(1, np.float32)
        for _ in range(200):
            flag[0] = float(engine.counters.fast_by_callers > 0)
            ringplug.allreduce(flag, op=ringplug.Min, out=flag, name="all-ran-now")
            if flag[0] == 1:
                break
        if rank == 1:
            fault("user code")
            freeze()
        print(f"fast cycles run by callers: {engine.counters.fast_by_callers}", flush=True)
        ringplug.allreduce(small, op=ringplug.Sum, out=small, name="warm-up")
        raise AssertionError("unreachable")
    if scenario == "gil":
        if rank == 1:
            fault("C code holding the GIL")
            ctypes.PyDLL(None).sleep(3600)  # PyDLL: the GIL stays held during the call
        forever(small)
    if scenario == "kill":
        if rank == 1:
            fault("SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)
        forever(small)
    if scenario == "engine-errors":
        engine_errors(rank, size, engine)
        return
    if scenario == "engine-dies":
        engine_dies(rank, engine)
        forever(small)
    if scenario == "engine-dies-in-ring":
        engine_dies_in_ring(rank, engine)
    if scenario == "exit-3":
        if rank == 0:
            fault("sys.exit(3)")
            sys.exit(3)
        forever(small)
    if scenario == "exit-0-early":
        if rank == 1:
            fault("os._exit(0)")
            os._exit(0)
        forever(small)
    if scenario == "nan":
        nan_everywhere(rank, size)
        return
    if scenario == "secret":
        secret(rank, extra[0])
        return
    raise SystemExit(f"unknown scenario {scenario!r}")


def engine_errors(rank: int, size: int, engine) -> None:
    transport = engine.transport
    allgather = transport.allgather

    def out_of_memory(send, rows):
        transport.allgather = allgather  # once
        raise MemoryError("cannot allocate the allgather result (injected)")

    if rank == 1:
        transport.allgather = out_of_memory
    rows = np.full((2, 3), rank, np.float32)
    try:
        ringplug.allgather(rows, name="gathered")
        print(f"rank {rank}: allgather succeeded", flush=True)
    except Exception as error:  # noqa: BLE001 - the test reads what each rank got
        print(f"rank {rank}: allgather raised {type(error).__name__}: {error}", flush=True)
    out = np.zeros(4, np.float32)
    if rank == 1:
        out.flags.writeable = False
    try:
        ringplug.allreduce(np.full(4, 1.0, np.float32), op=ringplug.Sum, out=out, name="ro")
        print(f"rank {rank}: read-only allreduce succeeded", flush=True)
    except Exception as error:  # noqa: BLE001
        print(
            f"rank {rank}: read-only allreduce raised {type(error).__name__}: {error}", flush=True
        )
    # A call of a form agreed before, larger than a message carries, runs its fast cycle on
    # the caller's thread and fails on rank 1 in the middle of its collective.
    mid = np.full(1 << 15, rank + 1.0, np.float32)
    for _ in range(2):
        ringplug.allreduce(mid, op=ringplug.Sum, out=mid, name="mid")
    fast = engine.counters.fast_by_callers > 0
    print(f"rank {rank}: mid ran a fast cycle: {fast}", flush=True)
    reduce_all = transport.allreduce

    def cannot_reduce(*args, **kwargs):
        transport.allreduce = reduce_all  # once
        raise MemoryError("cannot reduce (injected)")

    if rank == 1:
        transport.allreduce = cannot_reduce
    try:
        ringplug.allreduce(mid, op=ringplug.Sum, out=mid, name="mid")
        print(f"rank {rank}: mid allreduce succeeded", flush=True)
    except Exception as error:  # noqa: BLE001
        print(f"rank {rank}: mid allreduce raised {type(error).__name__}: {error}", flush=True)
    # The engine goes on serving: small (MPI) and large (ring) allreduces, and an allgather.
    for count in (8, 1 << 20):
        values = np.full(count, rank + 1, np.float32)
        ringplug.allreduce(values, op=ringplug.Sum, out=values, name=f"after-{count}")
        expected = size * (size + 1) / 2
        assert np.all(values == expected), (values[:4], expected)
    gathered = ringplug.allgather(np.full((1, 2), rank, np.int64), name="after-gather")
    assert gathered[:, 0].tolist() == list(range(size)), gathered
    print(f"rank {rank}: later collectives are correct", flush=True)


def engine_dies(rank: int, engine) -> None:
    if rank == 1:

        def broken(requests, error=None):
            # Also when the engine then fails the batch with this error: the cycle ends.
            raise RuntimeError("completing the batch failed (injected)")

        engine.complete_each = broken
    tensors = [np.full(256, rank + 1.0, np.float32) for _ in range(8)]
    handles = [
        ringplug.allreduce_async(t, op=ringplug.Sum, out=t, name=f"burst{i}")
        for i, t in enumerate(tensors)
    ]
    outcomes = []
    for handle in handles:
        try:
            handle.wait()
            outcomes.append("ok")
        except Exception as error:  # noqa: BLE001 - the test reads what each rank got
            outcomes.append(f"{type(error).__name__}: {error}")
    failed = [o for o in outcomes if o != "ok"]
    print(f"rank {rank}: {len(failed)} of {len(outcomes)} failed: {failed[:1]}", flush=True)
    if rank == 1:
        sys.exit(4)


def engine_dies_in_ring(rank: int, engine) -> None:
    big = np.ones(1 << 20, np.float32)  # 4 MiB: the ring (RINGPLUG_RING_THRESHOLD=64K)
    if rank == 1:
        begin = engine.begin_collective

        def broken(kind, responses):
            begin(kind, responses)
            fault("engine fails")
            raise RuntimeError("starting the collective failed (injected)")

        engine.begin_collective = broken
    try:
        ringplug.allreduce(big, op=ringplug.Sum, out=big, name="big")
    except Exception as error:  # noqa: BLE001 - the test reads what each rank got
        print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
    if rank == 1:
        sys.exit(4)
    forever(big)


def nan_everywhere(rank: int, size: int) -> None:
    wrong = []
    for count in (4, 1 << 21):  # below and above RINGPLUG_RING_THRESHOLD
        for holder in range(size):
            for op in (ringplug.Max, ringplug.Min):
                for dtype in (np.float32, np.float64):
                    values = np.full(count, float(rank), dtype)
                    if rank == holder:
                        values[1] = np.nan
                    ringplug.allreduce(values, op=op, out=values, name="nan")
                    if not np.isnan(values[1]) or np.isnan(values[0]):
                        wrong.append((count, holder, op.name, np.dtype(dtype).name))
    print(f"rank {rank}: nan results wrong in {wrong}", flush=True)


def secret(rank: int, digest: str) -> None:
    value = os.environ.get("RINGPLUG_TEST_SECRET", "")
    arrived = hashlib.sha256(value.encode()).hexdigest() == digest
    seen = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
            if value and any(value.encode() in word for word in words):
                seen.append(" ".join(w.decode(errors="replace") for w in words[:3]))
        except OSError:
            continue
    ringplug.barrier()  # every rank looks while the whole job runs
    print(f"rank {rank}: secret arrived={arrived}", flush=True)
    for where in seen:
        print(f"rank {rank}: secret on the command line of: {where}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3:])
