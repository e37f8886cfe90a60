"""The CUDA facilities the GPU data plane needs: the device, a stream, events, memory, copies.

One small interface (`DeviceRuntime`) with two implementations:

- `CudaRuntime` here: a ctypes binding to the CUDA runtime (``libcudart``), for frameworks
  whose streams and allocations are not reachable from Python (TensorFlow, JAX);
- `ringplug.torch.cuda.TorchCuda`: torch's own streams, events and caching allocator, so
  that ringplug's buffers live in torch's memory pool. The core never imports torch:
  ``import ringplug.torch`` registers it with `register_runtime`.

All addresses are device pointers as ints. The current CUDA device is per thread, so the
engine thread calls `set_device` before anything else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..dtypes import DType
from ..errors import RingplugError
from .libraries import mapped_library, pathfinder_library, wheel_library

LIBRARY_VARIABLE = "RINGPLUG_CUDART_LIB"
_WHEELS = ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12")  # CUDA 13, CUDA 12
_NOT_READY = 600  # cudaErrorNotReady
_NO_DEVICE = 100  # cudaErrorNoDevice
_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
DRIVER_PROC = "/proc/driver/nvidia"
"""Present where the NVIDIA kernel driver is loaded."""


class CudaError(RingplugError):
    """A CUDA runtime call failed, or there is no CUDA runtime or no GPU."""


class DeviceRuntime:
    """What the GPU data plane asks of a framework's CUDA facilities."""

    name = "abstract"
    # Whether `scale` works for every op (Min, Max and Product take their scale factors
    # as passes of their own; NCCL folds Sum's and Average's into the reduction).
    scales_every_op = False

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
            raise CudaError(f"{call} failed with CUDA error {result}: {self._text(result)}.")

    def device_count(self) -> int:
        """How many GPUs this process sees: 0 when there is none (cudaErrorNoDevice) or no
        NVIDIA driver at all (as torch says); any other error is one, said with what to do
        (error 35 with a driver: it is older than this CUDA runtime, as with a CUDA 12
        driver and the cu13 wheels; error 35 from a kernel driver whose libcuda.so.1 cannot
        be loaded, as in a container started without the NVIDIA runtime)."""
        count = ctypes.c_int()
        result = self.lib.cudaGetDeviceCount(ctypes.byref(count))
        if result == _NO_DEVICE:
            return 0
        # The runtime says 35 both where the driver is too old and where there is none: a
        # driver version of 0 is its word for "no libcuda.so.1 could be loaded".
        if result == _INSUFFICIENT_DRIVER and self.driver_version() == 0:
            if not os.path.exists(DRIVER_PROC):
                return 0  # a machine without an NVIDIA driver: no GPU, not an error
            raise CudaError(
                f"cudaGetDeviceCount failed with CUDA error 35: {self._text(result)}. The "
                f"NVIDIA kernel driver is loaded ({DRIVER_PROC} exists), but its library "
                "libcuda.so.1 cannot be loaded in this process. In a container, start it "
                "with the NVIDIA container runtime (`docker run --gpus all`); otherwise "
                "reinstall the driver, or add the folder of libcuda.so.1 to LD_LIBRARY_PATH."
            )
        if result == _INSUFFICIENT_DRIVER:
            raise CudaError(
                f"cudaGetDeviceCount failed with CUDA error 35: {self._text(result)}. The "
                f"NVIDIA driver supports CUDA {cuda_version_text(self.driver_version())}, older "
                f"than the CUDA runtime {cuda_version_text(self._version('Runtime'))} ringplug "
                f"loaded ({self.path}): update the driver, or install the runtime of the "
                "driver's CUDA (`pip install 'ringplug[cuda12]'` for a CUDA 12 driver)."
            )
        self.check(result, "cudaGetDeviceCount")
        return count.value

    def _text(self, result: int) -> str:
        return (self.lib.cudaGetErrorString(result) or b"").decode(errors="replace")

    def driver_version(self) -> int:
        """The CUDA version the NVIDIA driver supports (12080 for 12.8); 0 where there is
        no driver (no libcuda.so.1 could be loaded)."""
        return self._version("Driver")

    def _version(self, which: str) -> int:
        """cudaDriverGetVersion or cudaRuntimeGetVersion (0 when it fails)."""
        value = ctypes.c_int()
        function = getattr(self.lib, f"cuda{which}GetVersion", None)
        if function is None or function(ctypes.byref(value)) != 0:
            return 0
        return value.value

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


def cuda_version_text(code: int) -> str:
    """CUDA's version code as text (12080 is 12.8; 0: unknown)."""
    return f"{code // 1000}.{code % 1000 // 10}" if code else "(unknown)"


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
# A framework's facilities, registered by its adapter: (factory, whether it can serve now).
_registered: tuple[Callable[[], DeviceRuntime], Callable[[], bool]] | None = None


def register_runtime(factory: Callable[[], DeviceRuntime], usable: Callable[[], bool]) -> None:
    """Let a framework adapter provide the facilities (``ringplug.torch`` registers torch's):
    `default_runtime` makes one with `factory` when `usable()` says the framework has CUDA."""
    global _registered
    with _default_lock:
        _registered = (factory, usable)


def default_runtime() -> DeviceRuntime:
    """The registered framework's facilities when it has CUDA, else the CUDA runtime."""
    global _default
    with _default_lock:
        if _default is None:
            if _registered is not None and _registered[1]():
                _default = _registered[0]()
            else:
                _default = CudaRuntime()
        return _default
