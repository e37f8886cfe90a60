"""What the kinds' request builders share: naming, checking and submitting requests, and the
blocking forms made from the asynchronous ones."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ...wire import Kind, Signature, cacheable_name
from .. import runtime
from ..dtypes import DType, classify, storage_view
from ..engine.handles import Handle, Request
from ..errors import RingplugError
from ..gpu.device import DeviceBuffer, nccl_type
from ..ops import ReduceOp
from .kind import kind_of

if TYPE_CHECKING:
    from ..engine.engine import Engine

Finish = Callable[[Any], Any]
Build = Callable[[str], Request]

ArrayLike = Any  # numpy arrays and anything with the buffer protocol


def name_request(name: str | None, engine: Engine | None = None) -> tuple[str, bool]:
    """The request's name, and whether to cache it (see `engine.cacheable_name`)."""
    if name is not None:
        return str(name), cacheable_name(str(name))
    return (engine or runtime.engine()).unnamed(), False


def as_array(obj: ArrayLike) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        raise TypeError(
            f"ringplug collectives take numpy arrays or buffer-protocol objects, got "
            f"{type(obj).__name__}. Framework tensors go through ringplug.torch / ringplug.keras."
        ) from None


def contiguous(array: np.ndarray, code: DType) -> np.ndarray:
    view = storage_view(array, code)
    return view if view.flags.c_contiguous else np.ascontiguousarray(view)


class _BlockingCall(threading.local):
    """Per thread: `active` while a blocking form submits (its caller waits at once, and
    so runs the cycle itself). The class default spares a lookup that misses (getattr with
    a default cost 1.3 us, twice per asynchronous call; this, 0.05)."""

    active = False


_blocking_call = _BlockingCall()


def submit(name: str, cacheable: bool, build: Build, engine: Engine | None = None) -> Handle:
    """Build the request with `build(name)`; on bad arguments submit an error marker under
    the same name, so that every other rank's handle fails instead of waiting."""
    if engine is None:
        engine = runtime.engine()
    drive = _blocking_call.active
    try:
        request = build(name)
    except (TypeError, ValueError, NotImplementedError, RingplugError) as exc:
        # RingplugError: e.g. no NCCL or no GPU for a GPU tensor on this rank
        marker = Request(name, Signature(Kind.ERROR), Handle(name), error=exc)
        return engine.scheduler.submit(marker, drive)
    request.cacheable = cacheable and kind_of(request.signature.kind).cacheable
    return engine.scheduler.submit(request, drive)


class _WaitedAtOnce:
    """Submissions inside are waited for by their caller at once: the engine thread is not
    woken for them, as the caller runs their cycle itself (`Engine.drive`).

    A class, not a generator context manager: every synchronous call enters one, and the
    generator form cost 1.2 us of it (this, 0.7).
    """

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = _blocking_call.active
        _blocking_call.active = True

    def __exit__(self, *exc: object) -> None:
        _blocking_call.active = self._before


waited_at_once = _WaitedAtOnce


def waited_at_once_now() -> bool:
    """Whether this thread submits inside `waited_at_once` (its caller waits at once)."""
    return _blocking_call.active


def at_once(start: Callable[[], Any]) -> Any:
    """What the handle `start()` returns gives when waited for, its submissions made
    inside `waited_at_once`: the caller runs their cycle itself where the engine allows,
    and no engine thread is woken (for the blocking forms here and the framework layers'
    synchronous calls, which start an asynchronous one)."""
    with waited_at_once():
        handle = start()
    return handle.wait()


def submit_and_wait(name: str, cacheable: bool, build: Build) -> Any:
    """`_submit`, then wait, running the cycle on this thread (see `blocking`)."""
    return at_once(lambda: submit(name, cacheable, build))


def blocking(begin: Callable[..., Handle], returns: Any, doc: str) -> Callable[..., Any]:
    """The blocking form of the collective `begin` starts: the same parameters, and
    returns what its handle's `wait()` returns.

    The caller waits at once, so the engine thread is not woken: the caller runs the
    negotiation and the collective itself when the engine is free (`Engine.drive`).
    """

    @functools.wraps(begin)
    def run(*args: Any, **kwargs: Any) -> Any:
        return at_once(lambda: begin(*args, **kwargs))

    run.__name__ = run.__qualname__ = begin.__name__.removesuffix("_async")
    run.__doc__ = doc
    run.__signature__ = inspect.signature(begin).replace(return_annotation=returns)  # type: ignore[attr-defined]
    del run.__wrapped__  # help() shows `run`'s own signature and doc
    return run


def reject(error: BaseException, name: str | None = None) -> NoReturn:
    """Fail this call with `error` here, and the matching call on every other rank with
    `PeerArgumentError`, instead of leaving them waiting (for framework adapters)."""

    def build(_: str) -> Request:
        raise error

    own_name, _ = name_request(name)
    submit_and_wait(own_name, False, build)
    raise error


def check_root(root_rank: int) -> int:
    """`root_rank` as an int, or ValueError when it is not a rank of this job."""
    root, size = int(root_rank), runtime.size()
    if not 0 <= root < size:
        raise ValueError(f"root_rank={root} is not a rank of this job (ranks are 0..{size - 1}).")
    return root


def result_as(source: np.ndarray, result: np.ndarray) -> np.ndarray:
    """`result` in `source`'s dtype (results come back in the storage type)."""
    return result.view(source.dtype) if result.dtype != source.dtype else result


def in_place_arrays(
    arrays: Sequence[ArrayLike], counts: Sequence[int], dtype: str | DType | None, what: str
) -> tuple[list[np.ndarray], DType, tuple[int, ...]]:
    """The checked inputs of an in-place collective over blocks of any length: the arrays
    as flat views in their storage type, their dtype, and the counts."""
    sources = [as_array(a) for a in arrays]
    if not sources:
        raise ValueError(f"{what} needs at least one array.")
    codes = {classify(source, dtype) for source in sources}
    if len(codes) > 1:
        raise TypeError(f"{what} needs arrays of one dtype.")
    code = codes.pop()
    flat = [storage_view(source, code).reshape(-1) for source in sources]
    if any(not f.flags.c_contiguous or not f.flags.writeable for f in flat):
        raise ValueError(f"{what} needs contiguous, writable arrays.")
    total = sum(f.size for f in flat)
    blocks = tuple(int(c) for c in counts)
    if len(blocks) != runtime.size() or min(blocks) < 0 or sum(blocks) != total:
        raise ValueError(
            f"{what} needs one count per rank ({runtime.size()}), none negative, adding up "
            f"to the {total} elements given; got {list(blocks)}."
        )
    return flat, code, blocks


def start(name: str | None, build: Build) -> Handle:
    """Name the request (given, or the next unnamed one) and submit what `build` makes."""
    engine = runtime.engine()
    given_name, given = name_request(name, engine)
    return submit(given_name, given, build, engine)


def make(name: str, signature: Signature, **fields: Any) -> Request:
    """A request of `signature` with its own handle."""
    return Request(name, signature, Handle(name), **fields)


def check_buffers(buffers: Sequence[DeviceBuffer], what: str) -> None:
    """Raise if this rank's GPU plane cannot take `buffers` (no NCCL, no GPU, wrong GPU,
    a type NCCL lacks)."""
    # Only GPU jobs load NCCL and the CUDA runtime (and pay for importing their bindings).
    from ..gpu import nccl
    from ..gpu.cuda import default_runtime
    from ..gpu.plane import device_for_local_rank

    nccl.load()
    expected = device_for_local_rank(runtime.local_rank(), default_runtime().device_count())
    for buffer in buffers:
        nccl_type(buffer.code)
        if buffer.device != expected:
            raise ValueError(
                f"{what}: a tensor is on GPU {buffer.device}, but rank {runtime.rank()} (local "
                f"rank {runtime.local_rank()}) uses GPU {expected} for NCCL. Put the model and "
                f"data on cuda:{expected} (e.g. torch.cuda.set_device(local_rank()))."
            )


def check_scaling(op: ReduceOp, prescale: float, postscale: float) -> None:
    """Raise when scale factors go with an op that the CUDA runtime in use cannot scale."""
    from ..gpu.cuda import default_runtime  # GPU jobs only, as in `check_buffers`

    sums = op in (ReduceOp.SUM, ReduceOp.AVERAGE)
    scaled = (prescale, postscale) != (1.0, 1.0)
    if not sums and scaled and not default_runtime().scales_every_op:
        raise NotImplementedError(
            "scale factors with op=Min, Max or Product need torch on the GPU; use "
            "op=Sum or Average, or scale the tensors yourself."
        )
