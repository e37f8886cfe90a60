"""``hvd.elastic`` of ``ringplug.horovod.torch``: Horovod's ``horovod.torch.elastic``
(`run`, `TorchState`, `ElasticSampler`), which is `ringplug.elastic` and
`ringplug.torch.elastic` under Horovod's names, with Horovod's optimizer broadcast
(``hvd.broadcast_optimizer_state``, defined here for both).

Run a script as ``ringrun -np 3 --min-np 2 --max-restarts 2 python train.py``.
"""

from __future__ import annotations

import torch

from ..data import ElasticSampler
from ..elastic import HostsUpdatedInterrupt, ObjectState, State, run
from ..torch import averaging as _optimizer
from ..torch import elastic as _torch
from ..torch.state import broadcast_optimizer_state as _broadcast_optimizer_state
from ..torch.state import refuse_sharded

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None
) -> None:
    """Give every rank root's optimizer state and hyperparameters.

    As Horovod, an optimizer that has not stepped yet first takes one step with zero
    gradients on every rank (without reducing them), so that its state exists; the
    parameters that do not require grad are left without a gradient, the others with a
    zero one (a gradient they already had is kept).

    Unlike Horovod, that step moves no parameter: with weight decay (SGD's, Adam's,
    AdamW's decoupled one) or ASGD's averaging it would, and a script that broadcast
    the parameters before the optimizer state (Horovod's ImageNet example, resuming
    from its checkpoint) would leave the ranks that took it apart from root for good.
    The parameters and hyperparameters are put back as they were after the step (which
    holds a copy of the parameters, on their device, while it runs). Hooks registered on
    the optimizer's step still run for it, as in Horovod.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "broadcast_optimizer_state cannot broadcast torch.optim.LBFGS state; "
            "build it the same way on every rank instead."
        )
    refuse_sharded(optimizer)  # before the step that would create its state
    if not optimizer.state:
        _create_state(optimizer, _sparse_parameters(model))
    _broadcast_optimizer_state(optimizer, root_rank)


def _create_state(optimizer: torch.optim.Optimizer, sparse: set[int]) -> None:
    """One step with zero gradients, to create `optimizer`'s state, that leaves the
    parameters, the hyperparameters and the gradients it found as they were."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        values = [p.detach().clone() for p in params]
    gradients = [p.grad for p in params]
    settings = [
        {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
    ]
    # An LR scheduler marks the optimizer as stepped (to warn about a scheduler stepped
    # first); this step is not the user's.
    stepped = getattr(optimizer, "_opt_called", None)
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
            if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                p.grad = p.grad.to_sparse()
    # The wrapped optimizer's own step: a DistributedOptimizer's would reduce.
    if isinstance(optimizer, _optimizer._Distributed):
        super(_optimizer._Distributed, optimizer).step()
    else:
        optimizer.step()
    with torch.no_grad():
        for p, value in zip(params, values, strict=True):
            p.copy_(value)
    for p, gradient in zip(params, gradients, strict=True):
        if gradient is not None:
            p.grad = gradient
    for group, setting in zip(optimizer.param_groups, settings, strict=True):
        group.update(setting)
    if stepped is None:
        optimizer.__dict__.pop("_opt_called", None)
    else:
        optimizer._opt_called = stepped  # type: ignore[attr-defined]


def _sparse_parameters(model: torch.nn.Module | None) -> set[int]:
    if model is None:
        return set()
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.sparse
        for p in m.parameters()
    }


class TorchState(_torch.TorchState):
    """``hvd.elastic.TorchState``: `ringplug.torch.elastic.TorchState` whose sync gives the
    optimizer state as ``hvd.broadcast_optimizer_state`` does (a first step with zero
    gradients on an optimizer that has none yet)."""

    broadcast_optimizer = staticmethod(broadcast_optimizer_state)
