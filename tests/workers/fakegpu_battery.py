"""The GPU data plane's collectives, run on every rank against the fake NCCL and CUDA runtime.

``python fakegpu_battery.py SCENARIO``:
- ``battery``: every case of `CASES` (``FAKEGPU_CASES``: a comma list of name prefixes to
  run only some); each rank prints one ``case:`` JSON line per case with its inputs and
  what it got, and the test computes the expected results with numpy.
- ``sets``: some of the cases on two overlapping process sets of 3 ranks, each with an
  NCCL communicator of its own members (`run_on_sets`).
- ``init-frozen``: rank 1 never joins the NCCL communicator (blocked before
  ncclCommInitRankConfig); the others wait in the init.
- ``collective-frozen``: rank 1 never enqueues its part of the second allreduce.
- ``exits-in-collective``: rank 1's process ends inside its part of the second allreduce.

``FAKEGPU_PLANT`` plants a bug in ringplug's GPU path (the test proves the fake catches
it): ``op`` (Max sent as NCCL's Min), ``dtype-float32`` (float32 sent as NCCL's float64),
``dtype-bfloat16`` (bfloat16 sent as NCCL's float16), ``wait`` (the engine's stream does not
wait for the caller's event), ``scalar`` (a bfloat16 scale factor truncated).
``FAKEGPU_HOSTS=1`` gives each rank an NCCL_HOSTID of its own (ranks share the one fake GPU
as ranks on different hosts would).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
import threading
import zlib

import numpy as np

import ringplug
from ringplug.core import device_collectives as dc
from ringplug.core.dtypes import DType
from ringplug.core.gpu import cuda, nccl
from ringplug.core.gpu import plane as gpu
from ringplug.core.gpu.device import DeviceBuffer

RANK_ONE_STOPS = threading.Event()  # never set: rank 1 blocks on it

FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTEGERS = ["int8", "uint8", "int32", "int64"]
CODES = {name: DType[name.upper()] for name in FLOATS + INTEGERS}


def cases() -> list[dict]:
    """Every case: a collective, a dtype, an op and its arguments."""
    found = []
    for dtype in FLOATS + INTEGERS:
        ops = ["sum", "max", "min", "product"] + (["average"] if dtype in FLOATS else [])
        for op in ops:
            found.append(
                {"name": f"allreduce-{op}-{dtype}", "kind": "allreduce", "dtype": dtype, "op": op}
            )
    for dtype in FLOATS:
        for op, pre, post in [("sum", 3.0, 0.5), ("average", 0.5, 1.0), ("sum", 1 / 3, 1.0)]:
            found.append(
                {
                    "name": f"premul-{op}-{pre:.3g}-{post:g}-{dtype}",
                    "kind": "allreduce",
                    "dtype": dtype,
                    "op": op,
                    "pre": pre,
                    "post": post,
                }
            )
    found += [
        # Average of threes in bfloat16: exactly 3 when 1/size is rounded as torch rounds it.
        {
            "name": "average-threes-bfloat16",
            "kind": "allreduce",
            "dtype": "bfloat16",
            "op": "average",
            "fill": 3.0,
        },
        {
            "name": "fused-sum-float32",
            "kind": "allreduce",
            "dtype": "float32",
            "op": "sum",
            "tensors": 3,
        },
        {
            "name": "fused-average-bfloat16",
            "kind": "allreduce",
            "dtype": "bfloat16",
            "op": "average",
            "tensors": 2,
        },
        {
            "name": "fused-max-int32",
            "kind": "allreduce",
            "dtype": "int32",
            "op": "max",
            "tensors": 2,
        },
        {
            "name": "out-of-place-sum-float64",
            "kind": "allreduce",
            "dtype": "float64",
            "op": "sum",
            "out_of_place": True,
        },
        {
            "name": "ordered-sum-float32",
            "kind": "allreduce",
            "dtype": "float32",
            "op": "sum",
            "ordered": True,
        },
        {
            "name": "ordered-fused-sum-float32",
            "kind": "allreduce",
            "dtype": "float32",
            "op": "sum",
            "ordered": True,
            "tensors": 2,
        },
        {"name": "broadcast-root0-float16", "kind": "broadcast", "dtype": "float16", "root": 0},
        {"name": "broadcast-rootlast-int64", "kind": "broadcast", "dtype": "int64", "root": -1},
        {"name": "allgather-even-bfloat16", "kind": "allgather", "dtype": "bfloat16"},
        {
            "name": "allgather-uneven-float32",
            "kind": "allgather",
            "dtype": "float32",
            "uneven": True,
        },
        {
            "name": "reducescatter-even-sum-float32",
            "kind": "reducescatter",
            "dtype": "float32",
            "op": "sum",
        },
        {
            "name": "reducescatter-uneven-average-float64",
            "kind": "reducescatter",
            "dtype": "float64",
            "op": "average",
            "uneven": True,
        },
        {
            "name": "reducescatter-even-max-int32",
            "kind": "reducescatter",
            "dtype": "int32",
            "op": "max",
        },
    ]
    return found


def inputs(case: dict, rank: int, size: int, index: int = 0) -> np.ndarray:
    """This rank's input for `case` (float64 values that every dtype holds exactly)."""
    if "fill" in case:
        return np.full(5, case["fill"])
    seed = zlib.crc32(f"{case['name']}/{rank}/{index}".encode())
    generator = np.random.default_rng(seed)
    rows = 7 + index
    if case["kind"] == "allgather" and case.get("uneven"):
        rows = rank + 1
    if case["kind"] == "reducescatter":
        rows = 2 * size + (1 if case.get("uneven") else 0)
    if case["dtype"] == "uint8" or case.get("op") == "product":
        values = generator.integers(0, 3, rows)  # products stay small: 2**ranks at most
        if case["dtype"] != "uint8":
            values = values - 1  # -1, 0, 1
            values[0] = 2
    else:
        values = generator.integers(-8, 9, rows)
    return values.astype(np.float64)


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(dtype)


def from_storage(stored: np.ndarray, dtype: str) -> list[float]:
    if dtype == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64).tolist()
    return stored.astype(np.float64).tolist()


def read_device(buffer: DeviceBuffer) -> np.ndarray:
    """The fake's device memory is host memory: read a result buffer."""
    storage = buffer.code.storage
    raw = (ctypes.c_char * buffer.nbytes).from_address(buffer.address)
    return np.frombuffer(bytes(raw), storage).copy()


def buffer_of(array: np.ndarray, code: DType, device: int) -> DeviceBuffer:
    return DeviceBuffer(array.ctypes.data, array.size, code, device, array)


def run_case(case: dict, rank: int, size: int, device: int) -> dict:
    dtype, code = case["dtype"], CODES[case["dtype"]]
    count = case.get("tensors", 1)
    sources = [inputs(case, rank, size, i) for i in range(count)]
    stored = [to_storage(values, dtype) for values in sources]
    report = {"case": case["name"], "rank": rank, "inputs": [s.tolist() for s in sources]}
    name = f"c.{case['name']}"
    kind = case["kind"]
    if kind == "allreduce":
        ready = None
        if case.get("ordered"):
            # The values arrive on a stream of their own, 300 ms late; the collective is
            # told to wait for the event recorded after them, and nothing else.
            runtime = cuda.default_runtime()
            producer = runtime.new_stream()
            library = ctypes.CDLL(os.environ["RINGPLUG_CUDART_LIB"])
            library.fakeCudaSleep(ctypes.c_void_p(producer), 300)
            late = stored
            stored = [np.zeros_like(s) for s in late]
            for target, source in zip(stored, late, strict=True):
                runtime.copy(target.ctypes.data, source.ctypes.data, source.nbytes, producer)
            ready = runtime.record(producer)
            keep = late  # alive until the copies ran
        sends = [buffer_of(s, code, device) for s in stored]
        outs = sends
        if case.get("out_of_place"):
            results = [np.zeros_like(s) for s in stored]
            outs = [buffer_of(r, code, device) for r in results]
        dc.allreduce_async(
            sends,
            outs,
            [(s.size,) for s in stored],
            case["op"],
            prescale_factor=case.get("pre", 1.0),
            postscale_factor=case.get("post", 1.0),
            name=name,
            ready=ready,
        ).wait(timeout=60)
        report["out"] = [from_storage(read_device(out), dtype) for out in outs]
        if case.get("out_of_place"):
            report["sent_after"] = [from_storage(s, dtype) for s in stored]
        if case.get("ordered"):
            del keep
    elif kind == "broadcast":
        root = case["root"] % size
        dc.broadcast_async(
            buffer_of(stored[0], code, device), (stored[0].size,), root, name=name
        ).wait(timeout=60)
        report["out"] = [from_storage(stored[0], dtype)]
        report["root"] = root
    elif kind == "allgather":
        out = dc.allgather_async(
            buffer_of(stored[0], code, device), (stored[0].size,), name=name
        ).wait(timeout=60)
        report["out"] = [from_storage(read_device(out), dtype)]
    elif kind == "reducescatter":
        out = dc.reducescatter_async(
            buffer_of(stored[0], code, device), (stored[0].size,), case["op"], name=name
        ).wait(timeout=60)
        report["out"] = [from_storage(read_device(out), dtype)]
    return report


def plant(bug: str) -> None:
    """Put a known bug into ringplug's GPU path (the test shows the fake catches it)."""
    from ringplug.core.ops import ReduceOp

    if bug == "op":
        gpu._NCCL_OPS[ReduceOp.MAX] = nccl.OP_MIN
    elif bug.startswith("dtype-"):
        wrong = {"dtype-float32": (DType.FLOAT32, 8), "dtype-bfloat16": (DType.BFLOAT16, 6)}
        code, value = wrong[bug]
        original = gpu.nccl_type
        gpu.nccl_type = lambda c: value if c is code else original(c)
    elif bug == "wait":
        gpu.GpuPlane._wait_ready = lambda self, events: None
    elif bug == "scalar":
        original_bytes = gpu.scalar_bytes

        def truncated(value: float, code: DType) -> bytes:
            if code is DType.BFLOAT16:
                return struct.pack("<f", value)[2:]
            return original_bytes(value, code)

        gpu.scalar_bytes = truncated
    elif bug:
        raise SystemExit(f"unknown FAKEGPU_PLANT {bug!r}")


def freeze_rank_one_in(method: str, after: int = 0, exit_instead: bool = False) -> None:
    """On rank 1, block for ever (or end the process) inside `method` of the NCCL binding,
    from its `after`-th call on."""
    owner = nccl.Communicator
    original = getattr(owner, method)
    calls = []

    def stopped(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            print(f"rank 1 stops in {method}", flush=True)
            if exit_instead:
                os._exit(3)
            RANK_ONE_STOPS.wait()
        return original(self, *args, **kwargs)

    setattr(owner, method, stopped)


# The cases the ``sets`` scenario runs on each process set.
SET_CASES = (
    "allreduce-sum-float32",
    "allreduce-average-bfloat16",
    "fused-sum-float32",
    "broadcast-rootlast-int64",
    "allgather-uneven-float32",
    "reducescatter-even-sum-float32",
)


def run_on_sets(rank: int, device: int) -> None:
    """Two overlapping process sets of 3 ranks, [1, 2] and [0, 2], and [0, 1] made by its
    members only (rank 2 takes no part): each runs `SET_CASES` on its own engine, through an
    NCCL communicator of its own members (made at its first GPU collective); each member
    prints its report with the set's label and its rank in the set."""
    from ringplug.core import runtime

    made = {"A": ringplug.add_process_set([1, 2]), "B": ringplug.add_process_set([0, 2])}
    if rank in (0, 1):
        made["C"] = ringplug.add_process_set([0, 1], members_only=True)
    chosen = [case for case in cases() if case["name"] in SET_CASES]
    for label, process_set in made.items():
        if not process_set.included():
            continue
        token = runtime.scope.set(process_set._engine)
        try:
            for case in chosen:
                report = run_case(case, process_set.rank(), process_set.size(), device)
                report["case"] = f"{label}/{case['name']}"
                print("case:" + json.dumps(report), flush=True)
        finally:
            runtime.scope.reset(token)
    for label, process_set in made.items():
        ringplug.remove_process_set(process_set, members_only=label == "C")
    ringplug.barrier()


def main(scenario: str) -> None:
    ringplug.init()
    rank, size = ringplug.rank(), ringplug.size()
    if os.environ.get("FAKEGPU_HOSTS") == "1":
        os.environ["NCCL_HOSTID"] = f"fake-host-{rank}"
    devices = int(os.environ.get("FAKE_CUDA_DEVICES", "1"))
    device = ringplug.local_rank() if devices > 1 else 0
    plant(os.environ.get("FAKEGPU_PLANT", ""))
    if scenario == "battery":
        wanted = [p for p in os.environ.get("FAKEGPU_CASES", "").split(",") if p]
        for case in cases():
            if wanted and not any(case["name"].startswith(p) for p in wanted):
                continue
            print("case:" + json.dumps(run_case(case, rank, size, device)), flush=True)
        ringplug.barrier()
        return
    if scenario == "sets":
        run_on_sets(rank, device)
        return
    if scenario == "init-frozen" and rank == 1:
        freeze_rank_one_in("__init__")
    if scenario in ("collective-frozen", "exits-in-collective") and rank == 1:
        freeze_rank_one_in("allreduce", after=1, exit_instead=scenario == "exits-in-collective")
    values = np.ones(6, np.float32)
    buffers = [buffer_of(values, DType.FLOAT32, device)]
    for step in range(2):
        dc.allreduce_async(buffers, buffers, [(6,)], "sum", name=f"grads.{step}").wait()
        print(f"rank {rank} reduced step {step}", flush=True)
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
