"""Rank 0's buffers on every rank, as DDP's ``broadcast_buffers`` keeps them.

Buffers (BatchNorm's running statistics, counters) are not gradients: each rank's forward
moves them with its own batch, and nothing averages them. DDP sends rank 0's buffers to every
rank before a forward that follows a training forward, so ranks differ by the last forward's
update. `BufferSync`, for a module given to `ringplug.torch.DistributedOptimizer` as
``module`` or set up by `ringplug.fabric.RingFabricStrategy`, sends them with the last
gradients of each step, so every step ends with the same buffers on every rank, and, as a
forward pre-hook, before any other forward that follows a training forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Module

from .state import broadcast_buffers_async


class BufferSync:
    """Sends rank 0's buffers of `module` to every rank before a forward, when a forward
    since the last send may have changed them.

    A forward may change buffers when the module is in training mode or gradients are on
    (DDP's rule). While `blocked` (``fabric.no_backward_sync``, as DDP's ``no_sync``)
    forwards send nothing: the first forward after the accumulated step sends once.

    `DistributedOptimizer` (given ``module``, or set up by `RingFabricStrategy`) `start`s the
    send with the last gradients of each step and finishes it with them: it rides in engine
    cycles that run anyway, instead of being a wait of its own before the next forward, and
    the ranks end each step with the same buffers.
    """

    def __init__(self, module: Module, name: str) -> None:
        # Fixed at set-up, as DDP does: buffers are updated in place.
        self.buffers = [buffer for buffer in module.buffers() if buffer.numel()]
        self.name = name
        self.changed = False  # set_up sent rank 0's buffers already
        self.blocked = False  # inside no_backward_sync
        self._handle = module.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: Module, args: Any) -> None:
        self.sync()
        if module.training or torch.is_grad_enabled():
            self.changed = True

    def sync(self, force: bool = False) -> None:
        """Rank 0's buffers to every rank now, if a forward may have changed them (while
        `blocked` too with `force`)."""
        self.start(force)()

    def start(self, force: bool = False) -> Callable[[], None]:
        """Submit the send of rank 0's buffers, if a forward may have changed them (and
        not while `blocked`, unless `force`); call what it returns to finish it. The
        buffers must not change in between."""
        if not self.changed or (self.blocked and not force):
            return _nothing
        self.changed = False
        return broadcast_buffers_async(self.buffers, root_rank=0, name=self.name)

    def remove(self) -> None:
        self._handle.remove()


def _nothing() -> None:
    pass
