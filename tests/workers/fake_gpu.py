"""Multi-rank worker for the GPU data plane on the fake NCCL and CUDA runtime.

``python fake_gpu.py SCENARIO``:
- ``no-gpu``: every rank submits a GPU allreduce with no GPU visible; each prints its error.
- ``uid``: every rank submits a GPU broadcast, which makes the communicator; each prints
  the unique id it joined with (the fake refuses the broadcast itself over 2 ranks).
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
from ringplug.core.device import DeviceBuffer
from ringplug.core.dtypes import DType


def main(scenario: str) -> None:
    ringplug.init()
    values = np.ones(4, np.float32)
    buffers = [DeviceBuffer(values.ctypes.data, 4, DType.FLOAT32, 0, values)]
    if scenario == "no-gpu":
        try:
            dc.allreduce_async(buffers, buffers, [(4,)], "sum", name="grad").wait(timeout=60)
            print(f"no-gpu: rank {ringplug.rank()} ran it", flush=True)
        except Exception as error:  # noqa: BLE001 - printed for the test to read
            print(f"no-gpu: rank {ringplug.rank()}: {type(error).__name__}: {error}", flush=True)
    elif scenario == "uid":
        try:
            dc.broadcast_async(buffers[0], (4,), 0, name="weights").wait(timeout=60)
            error = ""
        except Exception as caught:  # noqa: BLE001
            error = str(caught)
        comm = runtime.engine()._gpu.comm
        lib = ctypes.CDLL(os.environ["RINGPLUG_NCCL_LIB"])
        lib.fakeNcclCommUid.restype = ctypes.c_char_p
        report = {
            "rank": ringplug.rank(),
            "pid": os.getpid(),
            "uid": lib.fakeNcclCommUid(ctypes.c_void_p(comm.handle)).decode(),
            "ranks": lib.fakeNcclCommRanks(ctypes.c_void_p(comm.handle)),
            "error": error,
        }
        print("uid:" + json.dumps(report), flush=True)
        return  # the failed broadcast aborted the communicator and failed the engine
    ringplug.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
