"""How tensors travel between ranks: `Compression`, the one definition every adapter uses
(``ringplug.torch``, the Lightning and Fabric strategies, and Horovod's
``hvd.Compression`` in ``ringplug.horovod.torch``, ``.keras`` and ``.tensorflow``).

Framework-neutral: it imports no framework, and casts torch tensors, TensorFlow tensors
and numpy arrays with their own framework's cast.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Sequence
from typing import Any


class Compression(str, enum.Enum):
    """How gradients travel: as they are (`none`), or floating ones as float16 (`fp16`:
    half the bytes, less precision).

    A member equals its value (``Compression.fp16 == "fp16"``) and is found by it
    (``Compression("fp16")``), so a strategy may take either. `compress` and `decompress`
    are Horovod's compressor interface, for collectives that compress one tensor at a
    time.

    Example:
        >>> sent, ctx = Compression.fp16.compress(tensor)  # doctest: +SKIP
        >>> result = Compression.fp16.decompress(allreduce(sent), ctx)
    """

    none = "none"
    fp16 = "fp16"

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """(what to send, what `decompress` needs): a floating `tensor` as float16 for
        `fp16`, else `tensor` itself and None."""
        if self is Compression.none or not _is_floating(tensor.dtype):
            return tensor, None
        return _cast(tensor, "float16"), tensor.dtype

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """`tensor` (what was sent, reduced) back in the dtype `compress` recorded in `ctx`."""
        return tensor if ctx is None else _cast(tensor, ctx)


def _is_floating(dtype: Any) -> bool:
    for flag in ("is_floating_point", "is_floating"):  # torch's dtypes, TensorFlow's
        if hasattr(dtype, flag):
            return bool(getattr(dtype, flag))
    return getattr(dtype, "kind", "") == "f"  # numpy's


def _cast(tensor: Any, dtype: Any) -> Any:
    """`tensor` as `dtype` (a name or the framework's dtype), by the tensor's framework."""
    framework = type(tensor).__module__.partition(".")[0]
    if framework == "torch":
        torch = sys.modules["torch"]  # loaded: the tensor is torch's
        return tensor.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if framework == "tensorflow":
        return sys.modules["tensorflow"].cast(tensor, dtype)
    return tensor.astype(dtype)


def compressed(
    compression: Any, tensors: Sequence[Any], collective: Callable[[list[Any]], Sequence[Any]]
) -> list[Any]:
    """`collective` (one result per tensor it is given) run on `tensors` as `compression`
    sends them, each result decompressed. `compression` is a `Compression` or any object
    with Horovod's ``compress`` and ``decompress``."""
    packed = [compression.compress(tensor) for tensor in tensors]
    results = collective([sent for sent, _ in packed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, packed, strict=True)]
