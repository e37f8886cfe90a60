"""The CUDA facilities the GPU data plane needs: the device, a stream, events, memory, copies.

Two implementations of one small interface (`DeviceRuntime`), chosen per framework:

- `TorchCuda`: torch's own (``torch.cuda`` streams and events, torch's caching
  allocator), used for torch tensors, so ringplug's buffers live in torch's memory pool;
- `CudaRuntime`: a ctypes binding to the CUDA runtime (``libcudart``), for frameworks whose
  streams and allocations are not reachable from Python (TensorFlow, JAX).

All addresses are device pointers as ints. The current CUDA device is per thread, so the
engine thread calls `set_device` before anything else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Any

import numpy as np

from .dtypes import DType
from .errors import RingplugError
from .libraries import mapped_library, pathfinder_library, wheel_library

LIBRARY_VARIABLE = "RINGPLUG_CUDART_LIB"
_WHEELS = ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12")  # CUDA 13, CUDA 12
_NOT_READY = 600  # cudaErrorNotReady
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2


class CudaError(RingplugError):
    """A CUDA runtime call failed, or there is no CUDA runtime or no GPU."""


class DeviceRuntime:
    """What the GPU data plane asks of a framework's CUDA facilities."""

    name = "abstract"

    def device_count(self) -> int:
        raise NotImplementedError

    def set_device(self, index: int) -> None:
        raise NotImplementedError

    def new_stream(self) -> Any:
        raise NotImplementedError

    def stream_handle(self, stream: Any) -> int:
        """The ``cudaStream_t`` of `stream`, for NCCL."""
        raise NotImplementedError

    def record(self, stream: Any) -> Any:
        """An event marking the work enqueued on `stream` so far."""
        raise NotImplementedError

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make later work on `stream` wait for `event` (no host blocking)."""
        raise NotImplementedError

    def query(self, event: Any) -> bool:
        """Whether the work before `event` has finished (never blocks)."""
        raise NotImplementedError

    def alloc(self, nbytes: int) -> tuple[int, Any]:
        """Device memory: (address, owner); the memory lives as long as the owner."""
        raise NotImplementedError

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Copy `nbytes` between device (or host) addresses, in `stream`'s order."""
        raise NotImplementedError

    def upload(self, dst: int, data: np.ndarray, stream: Any) -> None:
        """Copy a host array to `dst`, finished before this returns."""
        raise NotImplementedError

    def scale(self, address: int, count: int, code: DType, factor: float, stream: Any) -> None:
        """Multiply `count` elements at `address` by `factor`, in `stream`'s order."""
        raise NotImplementedError(
            f"scaling {code.label} data on the GPU needs torch; with {self.name} use op=Sum or "
            "Average (their scale factors are applied inside NCCL)."
        )


# ------------------------------------------------------------------ torch's facilities
class _DeviceArray:
    """A view of raw device memory that torch can wrap (CUDA array interface)."""

    def __init__(self, address: int, count: int, typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "strides": None,
            "typestr": typestr,
            "data": (address, False),
            "version": 3,
            "stream": None,  # ordering is ringplug's job (events)
        }


_TYPESTR = {
    DType.FLOAT16: "<f2",
    DType.FLOAT32: "<f4",
    DType.FLOAT64: "<f8",
    DType.BFLOAT16: "<u2",  # viewed as torch.bfloat16 after wrapping
}


class TorchCuda(DeviceRuntime):
    """torch.cuda's streams, events and allocator."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.device = 0

    def device_count(self) -> int:
        return self.torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        self.device = index
        self.torch.cuda.set_device(index)

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream(device=self.device)

    def stream_handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def record(self, stream: Any) -> Any:
        event = self.torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def alloc(self, nbytes: int) -> tuple[int, Any]:
        buffer = self.torch.empty(
            max(nbytes, 1), dtype=self.torch.uint8, device=f"cuda:{self.device}"
        )
        return buffer.data_ptr(), buffer

    def _bytes(self, address: int, nbytes: int) -> Any:
        return self.torch.as_tensor(
            _DeviceArray(address, nbytes, "|u1"), device=f"cuda:{self.device}"
        )

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if nbytes and dst != src:
            with self.torch.cuda.stream(stream):
                self._bytes(dst, nbytes).copy_(self._bytes(src, nbytes), non_blocking=True)

    def upload(self, dst: int, data: np.ndarray, stream: Any) -> None:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        with self.torch.cuda.stream(stream):
            self._bytes(dst, raw.nbytes).copy_(self.torch.from_numpy(raw))
        stream.synchronize()

    def scale(self, address: int, count: int, code: DType, factor: float, stream: Any) -> None:
        if factor == 1.0 or not count:
            return
        if code not in _TYPESTR:
            raise TypeError(f"scale factors need a floating-point type, got {code.label}.")
        values = self.torch.as_tensor(
            _DeviceArray(address, count, _TYPESTR[code]), device=f"cuda:{self.device}"
        )
        if code is DType.BFLOAT16:
            values = values.view(self.torch.bfloat16)
        with self.torch.cuda.stream(stream):
            values.mul_(factor)


# ------------------------------------------------------------------ the CUDA runtime
def cudart_candidates(environ: dict[str, str] | None = None) -> list[tuple[str, str | None]]:
    """The places the CUDA runtime is looked for, in order, with what each gives."""
    environ = dict(os.environ) if environ is None else environ
    explicit = environ.get(LIBRARY_VARIABLE, "")
    if explicit:
        return [(f"{LIBRARY_VARIABLE}={explicit}", explicit if os.path.exists(explicit) else None)]
    found = pathfinder_library("cudart")  # where installed, first (as for NCCL)
    places = [] if found is None else [found]
    places.append(("a libcudart already loaded", mapped_library("/libcudart.so")))
    places += [(f"the {wheel} wheel", wheel_library(wheel, "libcudart.so")) for wheel in _WHEELS]
    places.append(("the system library path", ctypes.util.find_library("cudart")))
    return places


class CudaRuntime(DeviceRuntime):
    """The CUDA runtime through ctypes (for TensorFlow and JAX buffers)."""

    name = "the CUDA runtime"

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        places = cudart_candidates(environ)
        path = next((p for _, p in places if p), None)
        if path is None:
            searched = "; ".join(place for place, _ in places)
            raise CudaError(
                f"No CUDA runtime library (libcudart) found (searched: {searched}). Install "
                "`pip install 'ringplug[cuda13]'` or `'ringplug[cuda12]'`, or set "
                f"{LIBRARY_VARIABLE}."
            )
        self.path = path
        self.lib = ctypes.CDLL(path)
        lib, c_int, c_void_p, c_size_t = self.lib, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        pointer = ctypes.POINTER
        for name, argtypes in {
            "cudaGetDeviceCount": [pointer(c_int)],
            "cudaSetDevice": [c_int],
            "cudaStreamCreateWithFlags": [pointer(c_void_p), ctypes.c_uint],
            "cudaStreamSynchronize": [c_void_p],
            "cudaEventCreateWithFlags": [pointer(c_void_p), ctypes.c_uint],
            "cudaEventRecord": [c_void_p, c_void_p],
            "cudaEventQuery": [c_void_p],
            "cudaEventDestroy": [c_void_p],
            "cudaStreamWaitEvent": [c_void_p, c_void_p, ctypes.c_uint],
            "cudaMalloc": [pointer(c_void_p), c_size_t],
            "cudaFree": [c_void_p],
            "cudaMemcpyAsync": [c_void_p, c_void_p, c_size_t, c_int, c_void_p],
        }.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, c_int
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [c_int], ctypes.c_char_p
        self._free_lock = threading.Lock()

    def check(self, result: int, call: str) -> None:
        if result != 0:
            text = (self.lib.cudaGetErrorString(result) or b"").decode(errors="replace")
            raise CudaError(f"{call} failed with CUDA error {result}: {text}.")

    def device_count(self) -> int:
        count = ctypes.c_int()
        result = self.lib.cudaGetDeviceCount(ctypes.byref(count))
        return count.value if result == 0 else 0  # cudaErrorNoDevice and friends: none

    def set_device(self, index: int) -> None:
        self.check(self.lib.cudaSetDevice(index), f"cudaSetDevice({index})")

    def new_stream(self) -> Any:
        stream = ctypes.c_void_p()
        self.check(
            self.lib.cudaStreamCreateWithFlags(ctypes.byref(stream), _STREAM_NON_BLOCKING),
            "cudaStreamCreateWithFlags",
        )
        return stream.value or 0

    def stream_handle(self, stream: Any) -> int:
        return int(stream)

    def record(self, stream: Any) -> Any:
        event = ctypes.c_void_p()
        self.check(
            self.lib.cudaEventCreateWithFlags(ctypes.byref(event), _EVENT_DISABLE_TIMING),
            "cudaEventCreateWithFlags",
        )
        self.check(self.lib.cudaEventRecord(event, stream), "cudaEventRecord")
        return _Event(self, event.value)

    def wait_event(self, stream: Any, event: Any) -> None:
        self.check(self.lib.cudaStreamWaitEvent(stream, event.handle, 0), "cudaStreamWaitEvent")

    def query(self, event: Any) -> bool:
        result = self.lib.cudaEventQuery(event.handle)
        if result == _NOT_READY:
            return False
        self.check(result, "cudaEventQuery")
        return True

    def alloc(self, nbytes: int) -> tuple[int, Any]:
        address = ctypes.c_void_p()
        self.check(
            self.lib.cudaMalloc(ctypes.byref(address), max(nbytes, 1)), f"cudaMalloc({nbytes})"
        )
        return address.value, _Allocation(self, address.value)

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if nbytes and dst != src:
            self.check(
                self.lib.cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream),
                "cudaMemcpyAsync",
            )

    def upload(self, dst: int, data: np.ndarray, stream: Any) -> None:
        raw = np.ascontiguousarray(data)
        self.copy(dst, raw.ctypes.data, raw.nbytes, stream)
        self.check(self.lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")


class _Event:
    def __init__(self, runtime: CudaRuntime, handle: int) -> None:
        self.runtime, self.handle = runtime, handle

    def __del__(self) -> None:
        self.runtime.lib.cudaEventDestroy(self.handle)


class _Allocation:
    def __init__(self, runtime: CudaRuntime, address: int) -> None:
        self.runtime, self.address = runtime, address

    def __del__(self) -> None:
        self.runtime.lib.cudaFree(self.address)


_default: DeviceRuntime | None = None
_default_lock = threading.Lock()


def default_runtime() -> DeviceRuntime:
    """torch's facilities when torch with CUDA is imported, else the CUDA runtime."""
    global _default
    with _default_lock:
        if _default is None:
            import sys

            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available():
                _default = TorchCuda()
            else:
                _default = CudaRuntime()
        return _default
