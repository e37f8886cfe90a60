"""Multi-rank worker for the GPU data plane on the fake NCCL and CUDA runtime.

``python fake_gpu.py SCENARIO``:
- ``no-gpu``: every rank submits a GPU allreduce with no GPU visible; each prints its error.
- ``uid``: every rank submits a GPU broadcast, which makes the communicator; each prints
  the unique id it joined with and what it received.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import numpy as np

import ringplug
from ringplug.core import device_collectives as dc
from ringplug.core import runtime
from ringplug.core.dtypes import DType
from ringplug.core.gpu.device import DeviceBuffer


def main(scenario: str) -> None:
    ringplug.init()
    values = np.ones(4, np.float32)
    # One fake GPU per local rank where there are several (as ringplug picks them).
    device = ringplug.local_rank() if int(os.environ.get("FAKE_CUDA_DEVICES", "1")) > 1 else 0
    buffers = [DeviceBuffer(values.ctypes.data, 4, DType.FLOAT32, device, values)]
    if scenario == "no-gpu":
        try:
            dc.allreduce_async(buffers, buffers, [(4,)], "sum", name="grad").wait(timeout=60)
            print(f"no-gpu: rank {ringplug.rank()} ran it", flush=True)
        except Exception as error:  # noqa: BLE001 - printed for the test to read
            print(f"no-gpu: rank {ringplug.rank()}: {type(error).__name__}: {error}", flush=True)
    elif scenario == "uid":
        values[:] = ringplug.rank() + 1
        dc.broadcast_async(buffers[0], (4,), 0, name="weights").wait(timeout=60)
        comm = runtime.engine()._gpu.comm
        lib = ctypes.CDLL(os.environ["RINGPLUG_NCCL_LIB"])
        lib.fakeNcclCommUid.restype = ctypes.c_char_p
        report = {
            "rank": ringplug.rank(),
            "pid": os.getpid(),
            "uid": lib.fakeNcclCommUid(ctypes.c_void_p(comm.handle)).decode(),
            "ranks": lib.fakeNcclCommRanks(ctypes.c_void_p(comm.handle)),
            "values": values.tolist(),
        }
        print("uid:" + json.dumps(report), flush=True)
    ringplug.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
