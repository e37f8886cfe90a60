"""Alltoall: rows `splits[i]` of each rank's array go to rank i."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...wire import Kind, Response, Signature
from .. import runtime
from ..dtypes import DType, classify
from ..engine.handles import Handle, Request
from .base import (
    ArrayLike,
    as_array,
    blocking,
    contiguous,
    result_as,
    start,
)
from .kind import Buffer, CollectiveKind, EngineView, SameEverywhere, register, shape_text


def alltoall_async(
    array: ArrayLike,
    splits: Sequence[int] | np.ndarray | None = None,
    *,
    name: str | None = None,
    dtype: str | DType | None = None,
) -> Handle:
    """Start an alltoall; the handle's `wait()` returns what `alltoall` returns."""

    def build(request_name: str) -> Request:
        source = as_array(array)
        code = classify(source, dtype)
        if source.ndim == 0:
            raise ValueError("alltoall needs an array with at least one dimension.")
        rows = _alltoall_rows(source.shape[0], splits, runtime.size())
        return Request(
            request_name,
            Signature(Kind.ALLTOALL, code, -1, -1, tuple(source.shape[1:])),
            Handle(request_name),
            Buffer(contiguous(source, code), splits=rows),
            extra=source.shape[0],
            finish=lambda result: (result_as(source, result[0]), result[1]),
        )

    return start(name, build)


alltoall = blocking(
    alltoall_async,
    tuple[np.ndarray, np.ndarray],
    """Send rows `splits[i]` of `array` to rank i; return what each rank sent here.

    Without `splits` the first dimension is split evenly (it must divide by the number
    of ranks). Returns the received rows concatenated in rank order, and the number of
    rows received from each rank.
    """,
)


def _alltoall_rows(first: int, splits: Sequence[int] | np.ndarray | None, size: int) -> np.ndarray:
    if splits is None:
        if first % size:
            raise ValueError(
                f"alltoall without splits divides the first dimension ({first}) evenly over "
                f"{size} ranks; pass splits= to send uneven blocks."
            )
        return np.full(size, first // size, np.int64)
    rows = np.asarray(splits, dtype=np.int64).reshape(-1)
    if rows.size != size or (rows < 0).any() or rows.sum() != first:
        raise ValueError(
            f"alltoall splits must be {size} non-negative row counts summing to the first "
            f"dimension ({first}); got {list(map(int, rows))}."
        )
    return rows


class Alltoall(CollectiveKind):
    label = "alltoall"

    def shape_text(self, signature: Signature) -> str:
        return f"with rows of shape {shape_text(signature.shape)}"

    def run_host(self, engine: EngineView, response: Response, request: Request | None) -> Any:
        if not all(response.have):
            raise SameEverywhere(f"alltoall {response.name!r} cannot run after a rank joined.")
        return engine.transport.alltoall(request.payload.send, request.payload.splits)


register(Kind.ALLTOALL, Alltoall())
