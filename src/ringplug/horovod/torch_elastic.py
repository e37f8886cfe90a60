"""``hvd.elastic`` of ``ringplug.horovod.torch``: Horovod's ``horovod.torch.elastic``
(`run`, `TorchState`, `ElasticSampler`), which is `ringplug.elastic` and
`ringplug.torch.elastic` under Horovod's names, with Horovod's optimizer broadcast.

Run a script as ``ringrun -np 3 --min-np 2 --max-restarts 2 python train.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..data import ElasticSampler
from ..elastic import HostsUpdatedInterrupt, ObjectState, State
from ..elastic import run as _run
from ..torch import elastic as _torch
from ._torch_state import broadcast_optimizer_state

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """``hvd.elastic.run``: see `ringplug.elastic.run`."""
    return _run(func)


class TorchState(_torch.TorchState):
    """``hvd.elastic.TorchState``: `ringplug.torch.elastic.TorchState` whose sync gives the
    optimizer state as ``hvd.broadcast_optimizer_state`` does (a first step with zero
    gradients on an optimizer that has none yet)."""

    broadcast_optimizer = staticmethod(broadcast_optimizer_state)
