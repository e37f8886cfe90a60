"""Seeded inputs and numpy references for the multi-rank collective tests.

Every rank can generate every other rank's input, so each rank checks its result against
a reference computed here, in plain numpy, independently of ringplug's code.
"""

from __future__ import annotations

import numpy as np

DTYPES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
)
OPS = ("sum", "average", "min", "max", "product")
# 0, 1, 7, not divisible by 2 or 3, and about a million elements.
COUNTS = (0, 1, 7, 1001, 1_000_003)


def is_float(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16", "float32", "float64")


def storage(dtype: str) -> np.dtype:
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def op_applies(op: str, dtype: str) -> bool:
    """Average is only defined for floating types (the error cases test the rest)."""
    return op != "average" or is_float(dtype)


def bf16_round(values: np.ndarray) -> np.ndarray:
    """float64 -> nearest bfloat16, returned as float64 (via float32, ties to even)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def to_bf16_words(values: np.ndarray) -> np.ndarray:
    """Exact bfloat16 values (float64) -> raw 16-bit words."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_words(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def values_for(op: str, dtype: str, count: int, rank: int, case: int) -> np.ndarray:
    """Rank `rank`'s input as exact float64 values representable in `dtype`."""
    rng = np.random.default_rng([case, rank, count])
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(np.float64)
    if op == "product":
        choices = [1, 2, -1] if dtype not in ("uint8",) else [1, 2, 3]
        return rng.choice(choices, count).astype(np.float64)
    low, high = (0, 60) if dtype == "uint8" else (-30, 30)
    values = rng.integers(low, high, count).astype(np.float64)
    if is_float(dtype):
        values = values / 4  # quarters: exact in every float type, sums stay exact
    return values


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return to_bf16_words(values)
    return values.astype(storage(dtype))


def decode(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return from_bf16_words(array)
    return array.astype(np.float64)


def reduce_reference(
    op: str, dtype: str, inputs: list[np.ndarray], pre: float = 1.0, post: float = 1.0
) -> np.ndarray:
    """The reduction in float64 of the exact inputs (bool as 0/1)."""
    stack = np.stack(inputs) * pre
    if dtype == "bool":
        result = {
            "sum": stack.max(0),
            "max": stack.max(0),
            "min": stack.min(0),
            "product": stack.min(0),
        }[op]
    elif op == "sum":
        result = stack.sum(0)
    elif op == "average":
        result = stack.sum(0) / len(inputs)
    elif op == "min":
        result = stack.min(0)
    elif op == "max":
        result = stack.max(0)
    else:
        result = stack.prod(0)
    return result * post


def tolerance(op: str, dtype: str) -> float:
    """Absolute-relative tolerance: exact except where a division or 16-bit rounding enters."""
    if dtype in ("float16", "bfloat16"):
        return 1e-2 if dtype == "bfloat16" else 2e-3
    if op == "average":
        return 1e-6 if dtype == "float32" else 1e-12
    return 0.0


def close(actual: np.ndarray, expected: np.ndarray, op: str, dtype: str) -> tuple[bool, float]:
    """Whether `actual` (decoded to float64) matches `expected`, and the worst error."""
    if actual.shape != expected.shape:
        return False, float("inf")
    if actual.size == 0:
        return True, 0.0
    if dtype == "bfloat16":
        expected = bf16_round(expected)
    error = np.abs(actual - expected) / np.maximum(1.0, np.abs(expected))
    worst = float(error.max())
    return worst <= tolerance(op, dtype), worst
