"""Device memory as the engine sees it: a typed address range on one GPU.

Framework adapters turn their tensors into `DeviceBuffer`s: torch through ``data_ptr()``,
TensorFlow and JAX through DLPack (`from_dlpack`), whose capsule is read here without
consuming it, so the producer keeps ownership and the buffer stays valid while the
capsule lives.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

from ..dtypes import DType

# DLPack's DLDeviceType values
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13
# Device types whose memory NCCL can read (tests with the fake CUDA runtime add DL_CPU).
NCCL_DEVICE_TYPES = {DL_CUDA, DL_CUDA_MANAGED}

# (DLDataTypeCode, bits) -> DType; codes: int 0, uint 1, float 2, bfloat 4, bool 6
_DLPACK_TYPES = {
    (2, 16): DType.FLOAT16,
    (4, 16): DType.BFLOAT16,
    (2, 32): DType.FLOAT32,
    (2, 64): DType.FLOAT64,
    (0, 8): DType.INT8,
    (0, 16): DType.INT16,
    (0, 32): DType.INT32,
    (0, 64): DType.INT64,
    (1, 8): DType.UINT8,
    (6, 8): DType.BOOL,
    (1, 1): DType.BOOL,
}

# NCCL's ncclDataType_t for each element type (bool travels as uint8; no int16 in NCCL).
NCCL_TYPES = {
    DType.INT8: 0,
    DType.UINT8: 1,
    DType.BOOL: 1,
    DType.INT32: 2,
    DType.INT64: 4,
    DType.FLOAT16: 6,
    DType.FLOAT32: 7,
    DType.FLOAT64: 8,
    DType.BFLOAT16: 9,
}


def nccl_type(code: DType) -> int:
    """NCCL's type for `code`; TypeError for the one NCCL lacks (int16)."""
    try:
        return NCCL_TYPES[code]
    except KeyError:
        raise TypeError(
            f"NCCL has no {code.label} type; convert GPU tensors to int32 (or a floating "
            "type) before reducing them."
        ) from None


@dataclasses.dataclass(eq=False)
class DeviceBuffer:
    """`count` elements of `code` at device address `address` on GPU `device`.

    `owner` keeps the memory alive (a tensor, a DLPack capsule, an allocation).
    """

    address: int
    count: int
    code: DType
    device: int
    owner: Any = None

    @property
    def nbytes(self) -> int:
        return self.count * self.code.itemsize

    def part(self, start: int, count: int) -> DeviceBuffer:
        """Elements [start, start + count) as a buffer of their own."""
        return DeviceBuffer(
            self.address + start * self.code.itemsize, count, self.code, self.device, self.owner
        )


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.argtypes, _get_pointer.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.argtypes, _is_valid.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_int


@dataclasses.dataclass(frozen=True)
class DLPackView:
    """What a DLPack capsule describes."""

    address: int
    device_type: int
    device_id: int
    code: DType
    shape: tuple[int, ...]
    contiguous: bool


def read_dlpack(capsule: Any) -> DLPackView:
    """Read an unconsumed ``dltensor`` capsule (the capsule keeps its ownership)."""
    if not _is_valid(capsule, b"dltensor"):
        raise TypeError("expected an unconsumed DLPack capsule named 'dltensor'.")
    tensor = _DLTensor.from_address(_get_pointer(capsule, b"dltensor"))
    kind = (tensor.dtype.code, tensor.dtype.bits)
    if tensor.dtype.lanes != 1 or kind not in _DLPACK_TYPES:
        raise TypeError(
            f"DLPack type code {kind[0]} with {kind[1]} bits and "
            f"{tensor.dtype.lanes} lanes is not a type ringplug reduces."
        )
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    contiguous = True
    if tensor.strides:
        expected = 1
        for axis in reversed(range(tensor.ndim)):
            if shape[axis] != 1 and tensor.strides[axis] != expected:
                contiguous = False
            expected *= shape[axis]
    return DLPackView(
        address=(tensor.data or 0) + tensor.byte_offset,
        device_type=tensor.device.device_type,
        device_id=tensor.device.device_id,
        code=_DLPACK_TYPES[kind],
        shape=shape,
        contiguous=contiguous,
    )


def from_dlpack(capsule: Any, owner: Any = None) -> DeviceBuffer:
    """A `DeviceBuffer` over a contiguous GPU tensor exported as a DLPack capsule.

    `owner` (the tensor) is kept alive with the capsule.
    """
    view = read_dlpack(capsule)
    if view.device_type not in NCCL_DEVICE_TYPES:
        raise TypeError(
            f"this tensor is not in GPU memory (DLPack device type "
            f"{view.device_type}); only CUDA tensors take the NCCL path."
        )
    if not view.contiguous:
        raise ValueError("the GPU data plane needs contiguous tensors; make a contiguous copy.")
    count = 1
    for extent in view.shape:
        count *= extent
    return DeviceBuffer(view.address, count, view.code, view.device_id, (capsule, owner))
