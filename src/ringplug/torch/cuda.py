"""torch's CUDA facilities for ringplug's GPU data plane: ``torch.cuda`` streams and events
and torch's caching allocator, so that ringplug's buffers live in torch's memory pool.

``import ringplug.torch`` registers `TorchCuda` with the core (`core.gpu.cuda.register_runtime`),
which never imports torch itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.dtypes import DType
from ..core.gpu.cuda import DeviceRuntime, register_runtime


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
    scales_every_op = True

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


def _usable() -> bool:
    import torch

    return torch.cuda.is_available()


def register() -> None:
    """Make torch's facilities the GPU data plane's whenever torch has CUDA."""
    register_runtime(TorchCuda, _usable)
