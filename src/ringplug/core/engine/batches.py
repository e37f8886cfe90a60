"""A plan's running order: fused batches of the kinds that fuse, other collectives alone."""

from __future__ import annotations

import math
from collections.abc import Iterator

from ...wire import Response
from ..dtypes import ITEMSIZE
from ..kinds.kind import kind_of


def batches(responses: list[Response], threshold: int) -> Iterator[list[Response] | Response]:
    """The plan in running order: lists of consecutive requests of a fused kind that may go
    together (its `fuses_with`, at most `threshold` bytes together, or one larger tensor),
    and every other collective alone."""
    if len(responses) == 1:  # a step's one collective (a synchronous call): nothing to group
        only = responses[0]
        yield [only] if kind_of(only.signature.kind).fused else only
        return
    batch: list[Response] = []
    batch_bytes = 0
    batch_kind = None
    for response in responses:
        signature = response.signature
        kind = kind_of(signature.kind)
        if not kind.fused:
            if batch:
                yield batch
                batch, batch_bytes = [], 0
            yield response
            continue
        nbytes = math.prod(signature.shape) * ITEMSIZE[signature.code]
        if batch and (
            kind is not batch_kind
            or not kind.fuses_with(batch[0].signature, signature)
            or batch_bytes + nbytes > threshold
        ):
            yield batch
            batch, batch_bytes = [], 0
        batch.append(response)
        batch_kind = kind
        batch_bytes += nbytes
    if batch:
        yield batch
