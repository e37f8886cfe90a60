"""Horovod's ``hvd.broadcast_optimizer_state`` for torch, which `ringplug.horovod.torch` and
its ``hvd.elastic`` states both use."""

from __future__ import annotations

import torch

from ..torch import optimizer as _optimizer
from ..torch.state import broadcast_optimizer_state as _broadcast_optimizer_state


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None
) -> None:
    """Give every rank root's optimizer state and hyperparameters.

    As Horovod, an optimizer that has not stepped yet first takes one step with zero
    gradients on every rank (without reducing them), so that its state exists; the
    parameters that do not require grad are left without a gradient.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "broadcast_optimizer_state cannot broadcast torch.optim.LBFGS state; "
            "build it the same way on every rank instead."
        )
    if not optimizer.state:
        sparse = _sparse_parameters(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                        p.grad = p.grad.to_sparse()
        # The wrapped optimizer's own step: a DistributedOptimizer's would reduce.
        if isinstance(optimizer, _optimizer._Distributed):
            super(_optimizer._Distributed, optimizer).step()
        else:
            optimizer.step()
    _broadcast_optimizer_state(optimizer, root_rank)


def _sparse_parameters(model: torch.nn.Module | None) -> set[int]:
    if model is None:
        return set()
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.sparse
        for p in m.parameters()
    }
