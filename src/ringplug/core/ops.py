"""Reduction operations that every collective and framework adapter shares."""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """How values from all ranks combine in `allreduce` and `reducescatter`.

    `AVERAGE` is `SUM` followed by a division by the number of ranks (it needs a
    floating-point dtype). On bool buffers `SUM` and `MAX` are logical or, `MIN`
    and `PRODUCT` logical and.
    """

    AVERAGE = 0
    SUM = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4


BY_CODE: tuple[ReduceOp, ...] = tuple(ReduceOp)  # ReduceOp by code, without an enum call


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_BY_NAME = {
    "average": Average,
    "avg": Average,
    "mean": Average,
    "sum": Sum,
    "min": Min,
    "max": Max,
    "product": Product,
    "prod": Product,
}


def as_op(op: ReduceOp | str | int) -> ReduceOp:
    """Normalise an op given as `ReduceOp`, its name ("sum", "mean", ...) or its value."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return _BY_NAME[op.lower()]
        except KeyError:
            raise ValueError(
                f"Unknown reduce op {op!r}; use one of {sorted(_BY_NAME)} or ringplug.Sum etc."
            ) from None
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(
            f"Unknown reduce op {op!r}; use ringplug.Average, Sum, Min, Max or Product."
        ) from None


def integer_scaling(op: ReduceOp, prescale: float, postscale: float, size: int) -> float | None:
    """How the framework adapters reduce integers with Average or scale factors, which the
    core refuses (it cannot be exact).

    Each rank multiplies its values by `prescale`, the core sums them, and the sum is
    multiplied by the factor returned (`postscale`, divided by `size` for Average); each
    product is taken in float64 and truncated toward zero, as Horovod does. None: there is
    nothing to scale, and the core reduces as asked.
    """
    if op is ReduceOp.AVERAGE:
        return postscale / size
    if op is ReduceOp.SUM and (prescale != 1.0 or postscale != 1.0):
        return postscale
    return None
