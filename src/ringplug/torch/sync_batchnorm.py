"""Batch normalization with statistics over the whole global batch, on CPU as on GPU.

torch's own ``SyncBatchNorm`` refuses CPU tensors and needs a torch.distributed group; this
one reduces through ringplug's core. In training each rank's per-channel count, mean and sum
of squared deviations are gathered and combined pairwise (Chan et al.), which stays exact
where ``E[x^2] - E[x]^2`` would cancel; backward sums ``dy`` and ``dy * x_hat`` over all
ranks in one allreduce. Weight and bias gradients stay local, like every other parameter's:
the optimizer averages them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import core
from .collectives import allgather, allreduce


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """`torch.nn.SyncBatchNorm` that synchronizes through ringplug (any input of 2 or more
    dimensions, channels on dimension 1).

    Outside training, in a world of one, or before ``ringplug.init()``, it is plain batch
    normalization. Build it with `convert_sync_batchnorm` from a model's ``BatchNorm*d``
    layers. It is still an instance of ``torch.nn.SyncBatchNorm``, so code that looks for
    synchronized layers (Lightning's ``revert``) finds it.

    Example:
        >>> model = ringplug.torch.SyncBatchNorm.convert_sync_batchnorm(model)  # doctest: +SKIP
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        if process_group is not None:
            raise ValueError(
                "ringplug.torch.SyncBatchNorm synchronizes over all ranks; "
                "leave process_group=None."
            )
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        uses_batch = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not (uses_batch and self.training and core.is_initialized() and core.size() > 1):
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                uses_batch,
                factor,
                self.eps,
            )
        return _SyncBatchNorm.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor
        )

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: Any = None
    ) -> torch.nn.Module:
        """Return ``module`` with every ``BatchNorm1d/2d/3d`` (and torch ``SyncBatchNorm``)
        replaced by a ringplug `SyncBatchNorm` sharing its parameters and running statistics."""
        if process_group is not None:
            raise ValueError(
                "ringplug.torch.SyncBatchNorm synchronizes over all ranks; "
                "leave process_group=None."
            )
        converted = module
        batchnorm = isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        if batchnorm and not isinstance(module, cls):
            converted = _rebuilt(module, cls)
            converted._ringplug_replaced = type(module)  # for revert_sync_batchnorm
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child))
        return converted


def _channel_view(values: torch.Tensor, dims: int) -> torch.Tensor:
    """Per-channel ``(C,)`` values shaped to broadcast against an input of ``dims`` dimensions."""
    return values.reshape((1, -1) + (1,) * (dims - 2))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        factor: float,
    ) -> torch.Tensor:
        channels = input.shape[1]
        reduced = [0] + list(range(2, input.dim()))
        count = input.numel() // channels
        x = input.to(torch.promote_types(input.dtype, torch.float32))  # 16-bit: in float32
        if count > 0:
            var, mean = torch.var_mean(x, dim=reduced, correction=0)
            m2 = var * count
        else:  # an empty shard on this rank still takes part
            mean = m2 = x.new_zeros(channels)
        local = torch.cat([x.new_full((1,), float(count)), mean, m2]).double().unsqueeze(0)
        stats = allgather(local)  # (ranks, 1 + 2C)
        counts, means, m2s = stats[:, :1], stats[:, 1 : 1 + channels], stats[:, 1 + channels :]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(
                f"SyncBatchNorm expects more than 1 value per channel when training "
                f"over all ranks, got {int(total)} (input shape on this rank "
                f"{list(input.shape)})."
            )
        global_mean = (counts * means).sum(0) / total
        global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)
        global_var = global_m2 / total
        invstd = torch.rsqrt(global_var + eps)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - factor).add_(global_mean.to(running_mean.dtype), alpha=factor)
            if running_var is not None:
                unbiased = global_m2 / (total - 1)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        mean, invstd = global_mean.to(x.dtype), invstd.to(x.dtype)
        x_hat = (x - _channel_view(mean, x.dim())) * _channel_view(invstd, x.dim())
        out = x_hat
        if weight is not None:
            out = out * _channel_view(weight.to(x.dtype), x.dim())
        if bias is not None:
            out = out + _channel_view(bias.to(x.dtype), x.dim())
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.total = total
        ctx.has_bias = bias is not None
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_hat, weight, invstd = ctx.saved_tensors
        dims = x_hat.dim()
        reduced = [0] + list(range(2, dims))
        dy = grad_out.to(x_hat.dtype)
        sum_dy = dy.sum(reduced)
        sum_dy_xhat = (dy * x_hat).sum(reduced)
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else grad_out.dtype)
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = allreduce(torch.cat([sum_dy, sum_dy_xhat]), "sum")
            channels = sum_dy.numel()
            mean_dy = _channel_view(both[:channels] / ctx.total, dims)
            mean_dy_xhat = _channel_view(both[channels:] / ctx.total, dims)
            scale = invstd if weight is None else invstd * weight.to(x_hat.dtype)
            grad_input = (dy - mean_dy - x_hat * mean_dy_xhat) * _channel_view(scale, dims)
            grad_input = grad_input.to(grad_out.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def revert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """Undo `SyncBatchNorm.convert_sync_batchnorm`: each ringplug `SyncBatchNorm` becomes the
    layer class it replaced again (``BatchNorm2d`` stays ``BatchNorm2d``), sharing its
    parameters and running statistics."""
    converted = module
    if isinstance(module, SyncBatchNorm):
        original = getattr(module, "_ringplug_replaced", torch.nn.SyncBatchNorm)
        if issubclass(original, torch.nn.SyncBatchNorm):
            original = _AnyBatchNorm  # a torch SyncBatchNorm would refuse CPU input again
        converted = _rebuilt(module, original)
    for name, child in module.named_children():
        converted.add_module(name, revert_sync_batchnorm(child))
    return converted


def _rebuilt(module: torch.nn.modules.batchnorm._BatchNorm, cls: type) -> torch.nn.Module:
    """A ``cls`` layer with ``module``'s settings, sharing its parameters and statistics."""
    layer = cls(
        module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
    )
    if module.affine:
        layer.weight = module.weight
        layer.bias = module.bias
    layer.running_mean = module.running_mean
    layer.running_var = module.running_var
    layer.num_batches_tracked = module.num_batches_tracked
    layer.train(module.training)
    if hasattr(module, "qconfig"):
        layer.qconfig = module.qconfig
    return layer


class _AnyBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization for input of any rank (what a torch SyncBatchNorm reverts to)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
