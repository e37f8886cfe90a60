"""Elastic torch training on ringrun's restarts: `TorchState` for `ringplug.elastic.run`.

Example::

    from ringplug import elastic
    from ringplug.torch.elastic import TorchState

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    state = TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: scale_lr(ringplug.size())])
    train(state)

Run it as ``ringrun -np 3 --min-np 2 --max-restarts 2 python train.py``.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ..elastic import ObjectState
from .state import broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState"]


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


class TorchState(ObjectState):
    """State of a torch training for `ringplug.elastic.run`: a model's and an optimizer's
    ``state_dict``, and any other keyword argument, kept as attributes (``state.model``,
    ``state.epoch``).

    A keyword value with ``state_dict``/``load_state_dict`` (more models and optimizers, an
    `ElasticSampler`, an LR scheduler) is kept by its state dict and loaded back into the
    same object; other values are kept as they are (they must pickle).

    Args:
        model: a ``torch.nn.Module`` (default None).
        optimizer: a ``torch.optim.Optimizer``, e.g. a ``ringplug.torch.DistributedOptimizer``
            (default None).
        **kwargs: more state, e.g. ``epoch=0, batch=0, train_sampler=sampler``.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model=model, optimizer=optimizer, **kwargs)

    # How `sync` gives every rank root's optimizer state (Horovod's state replaces it).
    broadcast_optimizer = staticmethod(broadcast_optimizer_state)

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
        optimizer state by `broadcast_optimizer`, the rest as objects."""
        rest = {}
        for name in self._names:
            value = getattr(self, name)
            if isinstance(value, torch.nn.Module):
                broadcast_parameters(value.state_dict(), root_rank=0)
            elif isinstance(value, torch.optim.Optimizer):
                self.broadcast_optimizer(value, root_rank=0)
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
