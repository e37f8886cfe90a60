"""Making every rank start from root's model and optimizer state."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..core import collectives as core
from ..core import runtime
from .collectives import TensorHandle, broadcast_async_


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int = 0,
) -> None:
    """Overwrite every rank's parameters (and buffers) with root's, in place.

    Args:
        params: a ``state_dict()`` or ``named_parameters()``; tensors are matched by name
            (sorted, so the order they come in does not matter), and every rank must pass
            the same names with the same shapes.
        root_rank: the rank whose values everyone gets. Defaults to 0.

    Example:
        >>> ringplug.torch.broadcast_parameters(model.state_dict(), root_rank=0)  # doctest: +SKIP
    """
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda kv: kv[0])
    handles: list[TensorHandle] = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor."
            )
        handles.append(broadcast_async_(tensor.data, root_rank, name=f"broadcast.{name}"))
    for handle in handles:
        handle.wait()


def broadcast_buffers(
    tensors: Iterable[torch.Tensor], root_rank: int = 0, name: str = "buffers"
) -> None:
    """Overwrite `tensors` (every rank passes the same list) with root's values, in place:
    one broadcast per device of their bytes, through a flat copy, cheap for many small
    tensors of several dtypes (BatchNorm's running statistics and its int64 counters)."""
    broadcast_buffers_async(tensors, root_rank, name)()


def broadcast_buffers_async(
    tensors: Iterable[torch.Tensor], root_rank: int = 0, name: str = "buffers"
) -> Callable[[], None]:
    """`broadcast_buffers`, submitted now; call what it returns to wait for it and write
    root's values into `tensors` (which must not change in between)."""
    groups: dict[str, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(str(tensor.device), []).append(tensor)
    pending = []
    for place, members in sorted(groups.items()):
        # Bytes, whatever the dtypes: one collective for floats and counters alike.
        flat = torch.cat([_bytes_of(t.detach().contiguous()) for t in members])
        handle = broadcast_async_(flat, root_rank, name=f"{name}.{place}")
        pending.append((handle, flat, members))

    def finish() -> None:
        for handle, flat, members in pending:
            handle.wait()
            offset = 0
            with torch.no_grad():
                for tensor in members:
                    size = tensor.numel() * tensor.element_size()
                    if tensor.is_contiguous():
                        _bytes_of(tensor).copy_(flat[offset : offset + size])
                    else:
                        values = flat[offset : offset + size].view(tensor.dtype)
                        tensor.copy_(values.view(tensor.shape))
                    offset += size

    return finish


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view of its storage."""
    return tensor.reshape(-1).view(torch.uint8)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank root's optimizer state (moments, step counts) and hyperparameters.

    The state travels as one pickled object (an initialisation-time cost), and is loaded
    with ``load_state_dict``, so every rank must have built the same optimizer over the
    same parameters. A sharded optimizer (``DistributedOptimizer(..., zero=1|2)``) is
    refused on every rank: each rank's state is its own shard.
    """
    refuse_sharded(optimizer)
    state = core.broadcast_object(
        optimizer.state_dict() if runtime.rank() == root_rank else None,
        root_rank,
        name="broadcast_optimizer_state",
    )
    if runtime.rank() != root_rank:
        optimizer.load_state_dict(state)


def refuse_sharded(optimizer: torch.optim.Optimizer) -> None:
    """Raise, on every rank (each decides alone: no rank is left waiting in a broadcast),
    when `optimizer` shards its state over the ranks."""
    if getattr(optimizer, "_ringplug_stage", 0):
        raise ValueError(
            "broadcast_optimizer_state does not apply to a sharded optimizer "
            "(DistributedOptimizer(..., zero=1|2)): each rank holds the state of its own "
            "parameters only, and a fresh one needs no broadcast. To resume from a "
            "checkpoint, call optimizer.load_state_dict(whole_state) on every rank (each "
            "keeps its shard); see docs/bigger-models.md."
        )


def broadcast_object(obj: Any = None, root_rank: int = 0, *, name: str | None = None) -> Any:
    """Root's picklable `obj` (tensors included) on every rank."""
    return core.broadcast_object(obj, root_rank, name=name)


def allgather_object(obj: Any, *, name: str | None = None) -> list[Any]:
    """Every rank's picklable `obj`, as a list in rank order."""
    return core.allgather_object(obj, name=name)
