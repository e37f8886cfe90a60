"""Local arithmetic of the collectives: combining two buffers, and scaling one.

Every rank runs exactly these kernels on the same inputs in the same order, which is
why ranks end bitwise identical. 16-bit floats are combined in float32 and rounded back
after each combination.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType, bfloat16_to_float32, float32_to_bfloat16
from ..ops import ReduceOp

UFUNCS = {
    ReduceOp.AVERAGE: np.add,
    ReduceOp.SUM: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}
# On bool stored as 0/1: or == max, and == min.
_BOOL_UFUNC = {
    ReduceOp.SUM: np.maximum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PRODUCT: np.minimum,
}


# Combined in another type than their own (see `combine`).
WIDENED = frozenset({DType.BOOL, DType.BFLOAT16, DType.FLOAT16})


def check_op(op: ReduceOp, code: DType, prescale: float, postscale: float) -> None:
    """Raise TypeError for an op or scaling that this element type cannot do exactly."""
    if code is DType.BOOL and op is ReduceOp.AVERAGE:
        raise TypeError("Average of bool buffers is undefined; use Sum (logical or) or Min.")
    if not code.is_floating:
        if op is ReduceOp.AVERAGE:
            raise TypeError(
                f"Average of {code.label} buffers cannot be exact; use op=Sum and divide, "
                "or convert to a floating-point type first."
            )
        if prescale != 1.0 or postscale != 1.0:
            raise TypeError(
                f"prescale_factor/postscale_factor need a floating-point buffer, got {code.label}."
            )


def combine_into(
    out: np.ndarray, first: np.ndarray, second: np.ndarray, op: ReduceOp, code: DType
) -> None:
    """out <- first (op) second: the values of copying `first` to `out`, then `combine`."""
    if code in WIDENED:
        np.copyto(out, first)
        combine(out, second, op, code)
    else:
        UFUNCS[op](first, second, out=out)


def combine(acc: np.ndarray, other: np.ndarray, op: ReduceOp, code: DType) -> None:
    """acc <- acc (op) other, elementwise; both in the storage type of `code`."""
    if code is DType.BOOL:
        ufunc = _BOOL_UFUNC[op]
        ufunc(acc.view(np.uint8), other.view(np.uint8), out=acc.view(np.uint8))
    elif code is DType.BFLOAT16:
        wide = bfloat16_to_float32(acc)
        UFUNCS[op](wide, bfloat16_to_float32(other), out=wide)
        float32_to_bfloat16(wide, acc)
    elif code is DType.FLOAT16:
        wide = acc.astype(np.float32)
        UFUNCS[op](wide, other, out=wide)
        acc[...] = wide
    else:
        UFUNCS[op](acc, other, out=acc)


def scale(values: np.ndarray, factor: float, code: DType) -> None:
    """values <- values * factor, in place (floating types only)."""
    if factor == 1.0:
        return
    if code is DType.BFLOAT16:
        wide = bfloat16_to_float32(values)
        wide *= np.float32(factor)
        float32_to_bfloat16(wide, values)
    elif code is DType.FLOAT16:
        values[...] = values.astype(np.float32) * np.float32(factor)
    else:
        np.multiply(values, factor, out=values, casting="unsafe")
