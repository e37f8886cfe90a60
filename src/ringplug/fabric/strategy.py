"""RingFabricStrategy: data-parallel training in Lightning Fabric with gradients averaged by
ringplug."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.nn import Module
from torch.optim import Optimizer

from ..compression import Compression
from ..torch import broadcast_parameters, check_agreement
from ..torch.buffers import BufferSync
from ..torch.optimizer import DEFAULT_BUCKET_BYTES, DistributedOptimizer
from .common import (
    RingParallel,
    configure_launcher,
    gather_over_ranks,
    know_rank_from_launcher,
    reduce_over_ranks,
)
from .environment import RingEnvironment
from .launcher import RingLauncher


class RingFabricStrategy(RingParallel, ParallelStrategy):
    """Lightning Fabric strategy that averages gradients over ranks through ringplug's engine.

    Start the ranks with the MPI launcher (``ringrun -np 4 python train.py``), or run
    ``python train.py`` with ``Fabric(strategy="ring", devices=4)`` and the script re-runs
    itself as 4 ranks under ringrun. ``fabric.setup(model, optimizer)`` gives every rank
    rank 0's parameters and buffers and wraps the optimizer so that gradients are averaged
    in buckets while backward runs: when ``fabric.backward(loss)`` returns, every rank holds
    the same averaged gradients (clip them, inspect them), and ``optimizer.step()`` keeps the
    weights identical. ``fabric.setup_dataloaders`` gives each rank its shard (a
    DistributedSampler); ``fabric.no_backward_sync(model)`` lets gradients accumulate
    locally, to be averaged once with the last micro-batch; ``fabric.all_reduce``,
    ``all_gather``, ``broadcast`` and ``barrier`` go through ringplug's engine, and so do
    torch.distributed calls (torchmetrics): the ``ringplug`` process group is set up at
    launch. On CPUs the gradients take ringplug's MPI ring; with ``accelerator="gpu"`` each
    rank uses the GPU of its local rank and the gradients take NCCL.

    Args:
        accelerator: set by Fabric. Defaults to ``None``.
        parallel_devices: set by Fabric. Defaults to ``None``.
        cluster_environment: defaults to `RingEnvironment` (the MPI world).
        checkpoint_io: defaults to Fabric's.
        precision: defaults to Fabric's.
        compression: ``"none"`` (default) or ``"fp16"`` for the gradients on the wire.
        gradient_predivide_factor: see `ringplug.torch.DistributedOptimizer`. Defaults to 1.0.
        bucket_bytes: gradient bucket size. Defaults to 25 MiB.
        timeline: path of a Chrome trace of the engine (rank 0). Defaults to ``None``.
        broadcast_buffers: rank 0's buffers (BatchNorm's running statistics) go to every
            rank with the last gradients of each backward (so ranks end each step with the
            same buffers), before any other forward that follows a training forward (as
            DDP's), and before ``fabric.save``. Defaults to ``True``.
        check_agreement: after each ``fabric.save``, check that every rank holds the same
            parameters and optimizer state (`ringplug.torch.check_agreement`: one read of
            them and a 16-byte collective; ranks that drifted apart raise
            `RanksDisagreeError` on every rank, naming the first tensor). Defaults to
            ``True``.

    Example:
        >>> fabric = Fabric(strategy=RingFabricStrategy(compression="fp16"))  # doctest: +SKIP
        >>> fabric.launch()
        >>> model, optimizer = fabric.setup(model, optimizer)
    """

    strategy_name = "ring"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        compression: Literal["none", "fp16"] | Compression = "none",
        gradient_predivide_factor: float = 1.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeline: str | None = None,
        broadcast_buffers: bool = True,
        check_agreement: bool = True,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment or RingEnvironment(),
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self.compression = Compression(compression)
        self.gradient_predivide_factor = gradient_predivide_factor
        self.bucket_bytes = bucket_bytes
        self.timeline = timeline
        self.broadcast_buffers = broadcast_buffers
        self.check_agreement = check_agreement
        self._modules: list[Module] = []  # set up, in order (the same on every rank)
        self._buffer_syncs: dict[int, BufferSync] = {}  # module id -> its sync, by set-up
        self._environment_ready = False
        self._backward_sync_control = _RingBackwardSyncControl(self)
        self._optimizers: list[Optimizer] = []  # distributed by setup_optimizer
        self._names: dict[int, str] = {}  # parameter id -> name, from the modules set up
        self._owns_process_group = False
        know_rank_from_launcher()

    def _set_world_ranks(self) -> None:
        self._speak_as_rank()  # fabric.print and rank_zero_* on rank 0 only

    def _configure_launcher(self) -> None:
        self._launcher = configure_launcher(self, RingLauncher, "Fabric")

    # ------------------------------------------------------------------ set-up
    def setup_environment(self) -> None:
        # Once: under ringrun, Fabric is set up when it is built (ringplug.fabric.patches),
        # and the script's own fabric.launch() comes after.
        if self._environment_ready:
            return
        self._start_ring()
        super().setup_environment()
        self._environment_ready = True

    def setup_module(self, module: Module) -> Module:
        """Every rank starts from rank 0's parameters and buffers (the module is not wrapped:
        the optimizers set up with it average its gradients), and gets rank 0's buffers again
        in each backward and before any other forward that follows a training forward
        (``broadcast_buffers``)."""
        broadcast_parameters(module.state_dict(), root_rank=0)
        self._names.update({id(p): name for name, p in module.named_parameters()})
        if all(known is not module for known in self._modules):
            self._modules.append(module)
        if self.broadcast_buffers and self.world_size > 1 and id(module) not in self._buffer_syncs:
            sync = BufferSync(module, name=f"fabric.buffers.{len(self._buffer_syncs)}")
            if sync.buffers:
                self._buffer_syncs[id(module)] = sync
            else:
                sync.remove()
        return module

    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """`optimizer`, wrapped so that its parameters' gradients are averaged over the ranks
        while backward runs (`ringplug.torch.DistributedOptimizer`)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        named = [(self._names[id(p)], p) for p in params if id(p) in self._names]
        distributed = DistributedOptimizer(
            optimizer,
            named_parameters=named if len(named) == len(params) else None,
            compression=self.compression,
            gradient_predivide_factor=self.gradient_predivide_factor,
            bucket_bytes=self.bucket_bytes,
        )
        # Averaged before fabric.backward returns, so clipping sees the averaged gradients.
        distributed._ringplug_sync_in_backward = True
        # Rank 0's buffers, as this step's forwards left them, go with the last gradients:
        # in the engine cycles that run anyway (sent while the backward computed, they kept
        # the engine polling through it; sent before the next forward, a wait of their own).
        distributed._ringplug_companions.append(self._start_buffer_syncs)
        self._optimizers.append(distributed)
        return distributed

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        module = self.setup_module(module)
        distributed = [self.setup_optimizer(optimizer) for optimizer in optimizers]
        for original, wrapped in zip(optimizers, distributed, strict=True):
            if scheduler is not None and getattr(scheduler, "optimizer", None) is original:
                scheduler.optimizer = wrapped  # it steps the learning rate of the one in use
        return module, distributed, scheduler

    # ------------------------------------------------------------------ steps
    def backward(
        self, tensor: torch.Tensor, module: Module | None, *args: Any, **kwargs: Any
    ) -> None:
        if not self._optimizers and self.world_size > 1:
            raise RuntimeError(
                "RingFabricStrategy averages gradients through the optimizers set up with "
                "Fabric, and none was: this backward would leave each rank with its own "
                "gradients. Pass the optimizer to fabric.setup(model, optimizer) (or to "
                "fabric.setup_optimizers) before training."
            )
        super().backward(tensor, module, *args, **kwargs)

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Fabric's save (every rank calls it), with rank 0's buffers on every rank first,
        then the check that the ranks agree: after the write, so that the checkpoint to
        resume from exists."""
        self._sync_buffers()
        super().save_checkpoint(*args, **kwargs)
        if self.check_agreement and self.world_size > 1:
            named = [
                (f"{index}.{name}", p)
                for index, module in enumerate(self._modules)
                for name, p in module.named_parameters()
            ]
            check_agreement(named, self._optimizers, where="at fabric.save")

    def _start_buffer_syncs(self) -> Any:
        finishers = [sync.start() for sync in self._buffer_syncs.values()]

        def finish() -> None:
            for done in finishers:
                done()

        return finish

    def _sync_buffers(self) -> None:
        for sync in self._buffer_syncs.values():
            sync.sync(force=True)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over ranks ("mean"/"avg", "sum", "max", "min" or a ReduceOp); a new
        tensor (the input is left as it is)."""
        return reduce_over_ranks(
            tensor, reduce_op, self.world_size, group, who="RingFabricStrategy.all_reduce"
        )

    def all_gather(
        self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """Every rank's tensor stacked on a new first dimension, as DDP's all_gather."""
        return gather_over_ranks(tensor, sync_grads, group, who="RingFabricStrategy.all_gather")

    def teardown(self) -> None:
        for optimizer in self._optimizers:
            optimizer.detach_hooks()
        self._optimizers.clear()
        self._modules.clear()
        for sync in self._buffer_syncs.values():
            sync.remove()
        self._buffer_syncs.clear()
        self._stop_ring()
        super().teardown()


class _RingBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: inside it, backward adds gradients up locally and
    sends nothing; the first backward outside averages the sum."""

    def __init__(self, strategy: RingFabricStrategy) -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        return self._blocked(module)

    @contextlib.contextmanager
    def _blocked(self, module: Module) -> Generator[None, None, None]:
        params = {id(p) for p in module.parameters()}
        owners = [
            optimizer
            for optimizer in self._strategy._optimizers
            if any(id(p) in params for group in optimizer.param_groups for p in group["params"])
        ]
        sync = self._strategy._buffer_syncs.get(id(module))
        for optimizer in owners:
            optimizer._ringplug_blocked = True
        if sync is not None:
            sync.blocked = True
        try:
            yield
        finally:
            for optimizer in owners:
                optimizer._ringplug_blocked = False
            if sync is not None:
                sync.blocked = False
