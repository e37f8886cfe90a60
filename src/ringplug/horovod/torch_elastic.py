"""``hvd.elastic`` of ``ringplug.horovod.torch``: Horovod's ``horovod.torch.elastic``
(`run`, `TorchState`, `ElasticSampler`) on ringrun's restarts; see `ringplug.horovod.elastic`
for how a job resumes.

Example::

    import ringplug.horovod.torch as hvd

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: scale_lr(hvd.size())])
    train(state)

Run it as ``ringrun -np 3 --min-np 2 --max-restarts 2 python train.py``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

from ..data import ElasticSampler
from ..torch.state import broadcast_parameters
from ._torch_state import broadcast_optimizer_state
from .elastic import HostsUpdatedInterrupt, ObjectState, State, run_fn

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function ``func(state, ...)``: on a restart it resumes from the
    last commit (calling the reset callbacks when the number of ranks changed), then every
    rank gets rank 0's state, then `func` runs. A lost peer ends the rank with its error,
    and ``ringrun --max-restarts N`` restarts the job."""
    return run_fn(func)


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


class TorchState(ObjectState):
    """State of a torch training: a model's and an optimizer's ``state_dict``, and any other
    keyword argument, kept as attributes (``state.model``, ``state.epoch``).

    A keyword value with ``state_dict``/``load_state_dict`` (more models and optimizers, an
    `ElasticSampler`, an LR scheduler) is kept by its state dict and loaded back into the
    same object; other values are kept as they are (they must pickle).

    Args:
        model: a ``torch.nn.Module`` (default None).
        optimizer: a ``torch.optim.Optimizer``, e.g. ``hvd.DistributedOptimizer`` (default
            None).
        **kwargs: more state, e.g. ``epoch=0, batch=0, train_sampler=sampler``.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model=model, optimizer=optimizer, **kwargs)

    def _snapshot(self) -> dict[str, tuple[str, Any]]:
        return {name: self._snapshot_of(getattr(self, name)) for name in self._names}

    def _apply(self, snapshot: dict[str, tuple[str, Any]]) -> None:
        for name, (kind, value) in snapshot.items():
            if kind == "state_dict":
                getattr(self, name).load_state_dict(value)
            else:
                setattr(self, name, value)

    def sync(self) -> None:
        """Give every rank rank 0's state: parameters and buffers broadcast in place,
        optimizer state as ``hvd.broadcast_optimizer_state``, the rest as objects."""
        rest = {}
        for name in self._names:
            value = getattr(self, name)
            if isinstance(value, torch.nn.Module):
                broadcast_parameters(value.state_dict(), root_rank=0)
            elif isinstance(value, torch.optim.Optimizer):
                broadcast_optimizer_state(value, root_rank=0)
            else:
                rest[name] = self._snapshot_of(value)
        self._apply(self._bcast_object(rest))
        self.save()

    def _snapshot_of(self, value: Any) -> tuple[str, Any]:
        if _has_state_dict(value):
            return ("state_dict", value.state_dict())
        return ("value", value)

    def _dumps(self, snapshot: Any) -> bytes:
        buffer = io.BytesIO()
        torch.save(snapshot, buffer)
        return buffer.getvalue()

    def _loads(self, data: bytes) -> Any:
        return torch.load(io.BytesIO(data), weights_only=False)
