"""The element types the core can move and reduce, and their wire codes.

Buffers reach the core as numpy arrays (anything with the buffer protocol is viewed as
one). bfloat16 has no numpy type: frameworks hand it over as raw 16-bit words together
with ``dtype="bfloat16"``, or as an ``ml_dtypes.bfloat16`` array (what TensorFlow and JAX
use); the core then reduces it in float32.
"""

from __future__ import annotations

import enum

import numpy as np


class DType(enum.IntEnum):
    """Wire code of an element type (the same code on every rank)."""

    FLOAT16 = 0
    BFLOAT16 = 1
    FLOAT32 = 2
    FLOAT64 = 3
    INT8 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    UINT8 = 8
    BOOL = 9

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def storage(self) -> np.dtype:
        """The numpy type the bytes are stored as (uint16 for bfloat16)."""
        return _STORAGE[self]

    @property
    def is_floating(self) -> bool:
        return self in FLOATING

    @property
    def itemsize(self) -> int:
        return _STORAGE[self].itemsize


# DType by wire code: BY_CODE[code] is DType(code) without the enum call, which is slow
# next to a tuple lookup (the engine converts several codes per collective).
BY_CODE: tuple[DType, ...] = tuple(DType)


_STORAGE: dict[DType, np.dtype] = {
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(np.uint16),
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.INT8: np.dtype(np.int8),
    DType.INT16: np.dtype(np.int16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.UINT8: np.dtype(np.uint8),
    DType.BOOL: np.dtype(np.bool_),
}
# Bytes per element by wire code: an enum's property (`code.itemsize`) is a Python call, and
# fusion reads it for every request.
ITEMSIZE: tuple[int, ...] = tuple(_STORAGE[code].itemsize for code in DType)
FLOATING = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64})
_BY_NUMPY = {dtype: code for code, dtype in _STORAGE.items() if code is not DType.BFLOAT16}
_BY_NAME = {code.label: code for code in DType}

SUPPORTED = ", ".join(code.label for code in DType)


def classify(array: np.ndarray, dtype: str | DType | None = None) -> DType:
    """Return the wire type of `array`, or raise TypeError naming the supported types.

    `dtype` reinterprets the buffer: ``dtype="bfloat16"`` for raw 16-bit words.
    """
    if dtype is None:
        code = _BY_NUMPY.get(array.dtype)
        if code is not None:
            return code
    else:
        code = dtype if isinstance(dtype, DType) else _BY_NAME.get(str(dtype).lower())
        if code is None:
            raise TypeError(f"Unsupported dtype {dtype!r}; ringplug reduces {SUPPORTED}.")
        if array.dtype.itemsize != code.itemsize:
            raise TypeError(
                f"A buffer of {array.dtype} ({array.dtype.itemsize} bytes per element) cannot "
                f"be read as {code.label} ({code.itemsize} bytes per element)."
            )
        return code
    if array.dtype.name == "bfloat16":  # ml_dtypes.bfloat16 (TensorFlow, JAX)
        return DType.BFLOAT16
    raise TypeError(
        f"Unsupported dtype {array.dtype}; ringplug reduces {SUPPORTED}. "
        "Convert the buffer first (for example to float32)."
    )


def storage_view(array: np.ndarray, code: DType) -> np.ndarray:
    """View `array` with the numpy type its bytes are reduced as."""
    storage = _STORAGE[code]  # not `code.storage`: an enum's property is a Python call
    return array if array.dtype == storage else array.view(storage)


def bfloat16_to_float32(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen bfloat16 words (uint16) to float32 exactly (bfloat16 is float32's top half)."""
    if out is None:
        out = np.empty(words.shape, np.float32)
    wide = out.view(np.uint32)
    np.left_shift(words, 16, out=wide, dtype=np.uint32)
    return out


def float32_to_bfloat16(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 words (nearest, ties to even; NaN stays NaN)."""
    bits = values.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    out[...] = rounded
    return out
