"""RingStrategy: data-parallel training in Lightning with gradients averaged by ringplug."""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Generator
from typing import Any, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from .. import core
from ..compression import Compression
from ..core import activity
from ..data.elastic_sampler import ElasticSampler
from ..diagnose import arrived as batch_arrived
from ..fabric.common import (
    RingParallel,
    configure_launcher,
    gather_over_ranks,
    know_rank_from_launcher,
    reduce_over_ranks,
)
from ..torch import broadcast_parameters, check_agreement
from ..torch.optimizer import DEFAULT_BUCKET_BYTES, DistributedOptimizer
from ..torch.state import broadcast_buffers
from ..torch.sync_batchnorm import SyncBatchNorm, revert_sync_batchnorm
from ..torch.zero import _Sharded
from .diagnostics import RingDiagnostics, diagnostics_for
from .environment import RingEnvironment
from .launcher import RingLauncher
from .resume import RingResume
from .uneven import AgreedLoader, SigtermFlag, Uneven, check_mode


class RingSyncBatchNorm(LayerSync):
    """``Trainer(sync_batchnorm=True)`` under `RingStrategy`: batch statistics over every rank
    through ringplug (torch's SyncBatchNorm refuses CPU tensors); ``revert`` restores the
    original layer classes."""

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        return SyncBatchNorm.convert_sync_batchnorm(model)

    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        return revert_sync_batchnorm(model)


class RingStrategy(RingParallel, ParallelStrategy):
    """Lightning strategy that averages gradients over ranks through ringplug's engine.

    Start the ranks with the MPI launcher (``ringrun -np 4 python train.py``); each rank
    trains on its shard of the data, gradients are averaged in buckets while backward runs,
    and every rank ends with the same weights. Where Lightning would add its
    ``DistributedSampler``, `ringplug.data.ElasticSampler` goes in (the same samples in the
    same order) and Lightning checkpoints hold its place (`ringplug.lightning.resume`): a fit
    resumed with ``ckpt_path="last"`` after a lost rank or a preemption (``ringrun
    --max-restarts``) goes on mid-epoch with the samples not trained yet, on the ranks there
    are then; SIGTERM saves ``last.ckpt`` (with ``ModelCheckpoint(save_last=True)``) at the
    batch where every rank stops.
    A stall report names where each missing rank is ("rank 1 was in forward/backward at
    epoch 0, batch 17 (step 17) for 61 s": the epoch, the batch within it, the global step).
    On CPUs the gradients take ringplug's MPI ring; with ``accelerator="gpu"`` each rank uses
    the GPU of its local rank and the gradients take NCCL.

    Args:
        accelerator: set by the Trainer. Defaults to ``None``.
        parallel_devices: set by the Trainer. Defaults to ``None``.
        cluster_environment: defaults to `RingEnvironment` (the MPI world).
        checkpoint_io: defaults to Lightning's.
        precision_plugin: defaults to Lightning's.
        compression: ``"none"`` (default) or ``"fp16"`` for the gradients on the wire.
        gradient_predivide_factor: see `ringplug.torch.DistributedOptimizer`. Defaults to 1.0.
        bucket_bytes: gradient bucket size. Defaults to 25 MiB.
        timeline: path of a Chrome trace of the engine (rank 0). Defaults to ``None``.
        broadcast_buffers: as DDP's: before each training step, rank 0's buffers (BatchNorm's
            running statistics) are copied to every rank, and again before evaluating or
            handing the model back after training, so every rank evaluates and saves the
            same model. Defaults to True.
        uneven: what to do when the ranks have different numbers of training batches
            (see `ringplug.lightning.uneven`): ``"drop"`` ends the epoch on every rank when
            the first runs out (rank 0 warns with the counts), ``"join"`` goes on until the
            last runs out, ranks without data contributing zero gradients (the average
            still divides by the number of ranks), ``"error"`` raises on every rank.
            Defaults to ``"drop"``. Evaluation is never padded: validation and test
            samplers give each sample to exactly one rank, so epoch metrics logged with
            ``sync_dist=True`` count every sample once.
        diagnose: the step-time breakdown (`ringplug.lightning.diagnostics`): at the end of
            fit rank 0 prints each rank's data / compute / communication / optimizer
            medians and names the bottleneck; the numbers go to the Trainer's loggers.
            ``True``, ``False``, or N to report every N steps too. Defaults to ``None``:
            ``RINGPLUG_DIAGNOSE`` (1/0, on when unset) and ``RINGPLUG_DIAGNOSE_EVERY``.
        check_agreement: at each checkpoint, once it is written, check that every rank
            holds the same parameters and optimizer state (`ringplug.torch.check_agreement`:
            about 5 ms per 100 MB on a CPU, one 16-byte collective) and raise
            `ringplug.torch.RanksDisagreeError` on every rank, naming the first tensor that
            differs, if not. Defaults to True.
        zero: shard the optimizer state over the ranks (ZeRO, see
            `ringplug.torch.DistributedOptimizer` and docs/bigger-models.md): ``0`` (default)
            every rank keeps all of it; ``1`` each rank keeps the state of its share of the
            parameters, steps them, and the weights are gathered back; ``2`` also keeps only
            its share of the averaged gradients. Also by name: ``strategy="ring_zero1"``,
            ``"ring_zero2"``. Checkpoints hold the whole optimizer state (gathered on rank 0
            as they are saved), so they resume on any number of ranks, or in one process
            without ringplug; clipping by norm takes the norm over every shard.

    Example:
        >>> trainer = Trainer(strategy=RingStrategy(), accelerator="cpu")  # doctest: +SKIP
    """

    strategy_name = "ring"
    # The registered names of the sharded stages (`register_strategies`).
    zero_names = {1: "ring_zero1", 2: "ring_zero2"}

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        compression: Literal["none", "fp16"] | Compression = "none",
        gradient_predivide_factor: float = 1.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeline: str | None = None,
        broadcast_buffers: bool = True,
        uneven: Uneven = "drop",
        diagnose: bool | int | None = None,
        check_agreement: bool = True,
        zero: Literal[0, 1, 2] = 0,
    ) -> None:
        _check_zero(zero, compression)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment or RingEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.compression = Compression(compression)
        self.gradient_predivide_factor = gradient_predivide_factor
        self.bucket_bytes = bucket_bytes
        self.timeline = timeline
        self.broadcast_buffers = broadcast_buffers
        self.uneven = check_mode(uneven)
        from . import patches  # here: the Trainer's module may be importing at ours

        patches.allow_compiled_models(RingStrategy)  # fit(torch.compile(model)), as DDP
        know_rank_from_launcher()
        self._buffers_changed = False
        self._phantoms: collections.deque[bool] = collections.deque()
        self._phantom_step = False
        self._sigterm: SigtermFlag | None = None
        self._next_loader_stage: RunningStage | None = None
        self.diagnose = diagnose
        self._diagnostics: RingDiagnostics | None = None
        self._resume: RingResume | None = None
        self.check_agreement = check_agreement
        self.zero = int(zero)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``"ring"``, and ``"ring_zero1"`` / ``"ring_zero2"`` for the sharded stages."""
        super().register_strategies(strategy_registry)
        for stage, name in cls.zero_names.items():
            strategy_registry.register(
                name,
                cls,
                description=f"Data-parallel training over ringplug's ring, ZeRO stage {stage} "
                "(sharded optimizer state)",
                override=True,
                zero=stage,
            )

    @property
    def _layer_sync(self) -> LayerSync | None:
        return self._ringplug_layer_sync

    @_layer_sync.setter
    def _layer_sync(self, plugin: LayerSync | None) -> None:
        # The Trainer hands its default for sync_batchnorm=True; ours works on CPU too.
        ours = type(plugin) is TorchSyncBatchNorm
        self._ringplug_layer_sync = RingSyncBatchNorm() if ours else plugin

    # ------------------------------------------------------------------ rank facts
    @property
    def is_distributed(self) -> bool:
        return True

    def set_world_ranks(self) -> None:
        self._speak_as_rank()

    def _configure_launcher(self) -> None:
        self._launcher = configure_launcher(self, RingLauncher, "Trainer")

    # ------------------------------------------------------------------ set-up
    def setup_environment(self) -> None:
        self._start_ring()
        super().setup_environment()
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is not None:
            _report_prepare_data(trainer)
            self._resume = _resume_callback(trainer)  # before Lightning restores a checkpoint

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        _refuse_scaler_with_zero2(self.zero, self.precision_plugin)
        _prepare_loaders_for_ring(trainer, self)
        from . import patches

        if self._resume is not None:
            patches.before_each_epoch(trainer, self._resume.before_epoch)
        self._sigterm = SigtermFlag(trainer)
        # The batch agreement already carries every rank's flag (see uneven.py).
        patches.replace_sigterm_broadcast(trainer, self._raise_if_sigterm)
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        broadcast_parameters(self.model.state_dict(), root_rank=0)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.optimizers = [self._distribute(optimizer) for optimizer in self.optimizers]
            if self.zero:
                # Lightning's clipping by norm sums over the gradients this rank holds:
                # with zero=2 its shard only. The optimizer's own takes every shard.
                patches.clip_norm_over_shards(self.precision_plugin, _Sharded)
        self.setup_precision_plugin()

    def _distribute(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        distributed = DistributedOptimizer(
            optimizer,
            named_parameters=self.model.named_parameters(),
            compression=self.compression,
            gradient_predivide_factor=self.gradient_predivide_factor,
            bucket_bytes=self.bucket_bytes,
            zero=self.zero,
        )
        distributed._ringplug_sync_in_backward = True
        for config in self.lr_scheduler_configs:
            if config.scheduler.optimizer is optimizer:
                config.scheduler.optimizer = distributed
        return distributed

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation passes: gradients add up locally and nothing is sent."""
        for optimizer in self.optimizers:
            optimizer._ringplug_blocked = True
        try:
            yield None
        finally:
            for optimizer in self.optimizers:
                optimizer._ringplug_blocked = False

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        """The training dataloader resumes where a checkpoint's epoch stopped (`RingResume`)
        and gets the per-batch agreement of the ranks (`AgreedLoader`)."""
        stage, self._next_loader_stage = self._next_loader_stage, None
        if stage is not RunningStage.TRAINING:
            return dataloader
        if self._resume is not None:
            trainer = self.lightning_module.trainer
            epoch = trainer.fit_loop.epoch_progress.current.processed  # the one to train next
            dataloader = self._resume.track(dataloader, epoch)
        if core.size() == 1:
            return dataloader
        assert self._sigterm is not None
        return AgreedLoader(dataloader, self.uneven, self._phantoms, self._sigterm)

    def _raise_if_sigterm(self) -> None:
        """Lightning's per-batch SIGTERM check, answered by the last batch agreement: every
        rank stops at the same batch when any rank received SIGTERM."""
        if self._sigterm is not None and self._sigterm.seen:
            raise SIGTERMException()

    # ------------------------------------------------------------------ steps
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, which runs the closure (forward and backward) inside
        ``optimizer.step``. A sharded optimizer must not average before the closure: the
        closure's backward does (its end averages what is left), and with zero=2 an early
        reduce-scatter would drop the gradients of the micro-batches accumulated so far
        that this rank does not own."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        module = self.lightning_module
        if isinstance(inner, _Sharded) and module is not None and module.automatic_optimization:
            inner._ringplug_synchronized = True  # as after every step but the first
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        activity.set_position(epoch=trainer.current_epoch, step=trainer.global_step)
        self._diagnostics = diagnostics_for(self.diagnose, trace=True)
        if self._diagnostics is not None:
            self._diagnostics.on_train_start(trainer)

    def on_train_end(self) -> None:
        if self._diagnostics is not None:
            self._diagnostics.on_train_end()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Where this rank is, for the stall reports; the optimizer step counts itself on.
        trainer = self.lightning_module.trainer
        activity.set_position(
            epoch=trainer.current_epoch, batch=batch_idx, step=trainer.global_step
        )
        super().on_train_batch_start(batch, batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_arrived()
        # A repeated batch of a rank out of data (uneven="join") counts zero (see backward).
        self._phantom_step = bool(self._phantoms.popleft()) if self._phantoms else False
        self._sync_buffers(force=True)
        output = super().training_step(*args, **kwargs)
        self._buffers_changed = True  # this rank's batch moved its running statistics
        return output

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._phantom_step:
            closure_loss = closure_loss * 0.0  # zero gradients, same collectives as the others
        return super().backward(closure_loss, *args, **kwargs)

    # Evaluation starts from rank 0's buffers (once per loop: ranks may run different numbers
    # of evaluation batches, so nothing is sent per batch).
    def on_validation_start(self) -> None:
        self._sync_buffers()

    def on_test_start(self) -> None:
        self._sync_buffers()

    def on_predict_start(self) -> None:
        self._sync_buffers()

    def _sync_buffers(self, force: bool = False) -> None:
        """Rank 0's buffers to every rank (one broadcast per dtype), when they may differ."""
        if not self.broadcast_buffers or not (force or self._buffers_changed):
            return
        self._buffers_changed = False
        if self.model is None or core.size() == 1:
            return
        buffers = [b for b in self.model.buffers() if b.numel()]
        if buffers:
            broadcast_buffers(buffers, root_rank=0, name="buffers")

    # ------------------------------------------------------------------ collectives
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Lightning's save (rank 0 writes), then, on every rank, the check that the ranks
        still agree: after the write, so that the checkpoint to resume from exists."""
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.check_agreement and self.world_size > 1:
            check_agreement(
                self.lightning_module,
                # A sharded optimizer's state differs by rank: only the weights must agree.
                [o for o in self.optimizers if not isinstance(o, _Sharded)],
                where=f"at the checkpoint of step {checkpoint.get('global_step', '?')}",
            )

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state for a checkpoint. Sharded (zero=1, 2): every rank sends its
        shard to rank 0, which returns the whole state (the dict a plain optimizer of the
        same class gives, loadable on any number of ranks) and writes the checkpoint; the
        other ranks return an empty dict, as for torch's ZeroRedundancyOptimizer."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not isinstance(inner, _Sharded):
            return super().optimizer_state(optimizer)
        inner.consolidate_state_dict(to=0)
        return inner.state_dict() if self.is_global_zero else {}

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over ranks ("mean"/"avg", "sum", "max", "min" or a ReduceOp)."""
        return reduce_over_ranks(tensor, reduce_op, self.world_size, group)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False):
        """Every rank's tensor stacked on a new first dimension, as DDP's all_gather."""
        return gather_over_ranks(tensor, sync_grads, group)

    def on_exception(self, exception: BaseException) -> None:
        # This rank is failing: its peers are elsewhere, so teardown must not wait for them.
        self._failed = True

    def teardown(self) -> None:
        if not getattr(self, "_failed", False):
            self._sync_buffers()  # hand back the same model on every rank
        module = self.lightning_module
        fitted = (
            module is not None
            and module._trainer is not None
            and module._trainer.state.fn == TrainerFn.FITTING
        )
        if fitted and self._layer_sync and self.model is not None:
            self.model = self._layer_sync.revert(self.model)  # as DDP: plain layers after fit
        for optimizer in self.optimizers:
            if hasattr(optimizer, "detach_hooks"):
                optimizer.detach_hooks()  # a later fit of the same model starts afresh
        activity.set_position()  # this fit's position ends with it
        self._stop_ring()
        super().teardown()


def _check_zero(zero: Any, compression: Any) -> None:
    """Refuse a stage that does not exist, or zero=2 with compressed gradients, when the
    strategy is made (a LightningCLI config fails at once, not after the set-up)."""
    if isinstance(zero, bool) or zero not in (0, 1, 2):
        raise ValueError(
            f"RingStrategy(zero=...) must be 0 (no sharding), 1 (optimizer state sharded) or 2 "
            f"(optimizer state and gradients sharded), got {zero!r}."
        )
    if zero == 2 and Compression(compression) is not Compression.none:
        raise ValueError(
            "RingStrategy(zero=2) sends each gradient to its owner uncompressed; use zero=1 "
            "with compression='fp16', or zero=2 with compression='none'."
        )


def _refuse_scaler_with_zero2(zero: int, precision_plugin: Any) -> None:
    """zero=2 with a gradient scaler ("16-mixed" on GPUs) is refused: the scaler looks for
    inf/NaN in the gradients this rank holds, its shard only, so the ranks would disagree on
    which steps to skip and stop meeting in the same collectives."""
    if zero == 2 and getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "RingStrategy(zero=2) cannot run with a gradient scaler (precision='16-mixed'): "
            "the scaler checks for inf/NaN only in the gradients a rank holds, with zero=2 "
            "its shard, and the ranks would disagree on which steps to skip. Use zero=1, or "
            "precision='bf16-mixed' (no scaler)."
        )


def _report_prepare_data(trainer: Any) -> None:
    """While Lightning runs ``prepare_data`` (next, in this fit), this rank's phase says so:
    the ranks that do not prepare the data wait for the one that does at a barrier
    (Lightning's, a ``monitored_barrier`` of up to ``RINGPLUG_BARRIER_TIMEOUT``), and a stall
    report then names that rank as "in prepare_data" rather than as missing."""
    from . import patches

    patches.around_prepare_data(
        trainer,
        before=lambda: activity.set_phase(activity.PREPARING_DATA),
        after=lambda: activity.set_phase(activity.BETWEEN_STEPS),
    )


def _resume_callback(trainer: Any) -> RingResume:
    """The Trainer's `RingResume`, added if it has none (a second fit finds the first's)."""
    for callback in trainer.callbacks:
        if isinstance(callback, RingResume):
            return callback
    callback = RingResume()
    trainer.callbacks.append(callback)
    return callback


def _elastic_sampler_for(dataloader: Any, connector: Any, trainer: Any) -> ElasticSampler | None:
    """The `ElasticSampler` that stands for the ``DistributedSampler`` Lightning would put in
    this training DataLoader (the same samples in the same order, and resumable mid-epoch),
    or None where Lightning would not, or would wrap a sampler of the user's."""
    if not (
        isinstance(dataloader, DataLoader)
        and connector._requires_distributed_sampler(dataloader)
        and isinstance(dataloader.sampler, (RandomSampler, SequentialSampler))
        and type(dataloader.batch_sampler) is BatchSampler
        and dataloader.batch_size is not None
    ):
        return None
    return ElasticSampler(
        dataloader.dataset,
        shuffle=not trainer.overfit_batches,  # Lightning shuffles training data, as here
        seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),  # Lightning's seed_everything
        batch_size=dataloader.batch_size,
        **trainer.distributed_sampler_kwargs,
    )


def _prepare_loaders_for_ring(trainer: Any, strategy: RingStrategy) -> None:
    """Adjust how Lightning prepares dataloaders for RingStrategy:

    - A sampler or batch sampler that already shards by rank (``shards_by_rank``, as
      ringplug's ElasticSampler and DistributedBucketSampler) keeps its DataLoader as it is
      (Lightning would wrap or replace the sampler, and raise for custom batch samplers made
      outside a ``*_dataloader`` hook).
    - Where Lightning would put a ``DistributedSampler`` in the training DataLoader, an
      `ElasticSampler` goes in: it deals the same samples in the same order, and a checkpoint
      holds its place, so a fit resumed mid-epoch trains the rest of the epoch, each sample
      once, on as many ranks as there are then (see `ringplug.lightning.resume`).
    - Validation and test get a sampler that gives each sample to exactly one rank
      (Lightning's DistributedSampler pads the ranks with repeated samples), so that
      metrics synced at the epoch's end count every sample once.
    - The strategy learns which stage the next `process_dataloader` call is for.
    """
    from . import patches

    patches.replace_prepare_dataloader(
        trainer, lambda prepare: _for_ring(prepare, trainer, strategy)
    )


def _for_ring(prepare: Any, trainer: Any, strategy: RingStrategy) -> Any:
    """Lightning's `prepare` (``_DataConnector._prepare_dataloader``), as RingStrategy needs it
    (see `_prepare_loaders_for_ring`)."""
    connector = trainer._data_connector

    def prepare_for_ring(dataloader: Any, shuffle: bool, mode: Any) -> Any:
        strategy._next_loader_stage = mode
        if any(
            getattr(getattr(dataloader, name, None), "shards_by_rank", False)
            for name in ("batch_sampler", "sampler")
        ):
            return dataloader
        if mode is RunningStage.TRAINING:
            sampler = _elastic_sampler_for(dataloader, connector, trainer)
            if sampler is not None:
                return _update_dataloader(dataloader, sampler, mode=mode)
        evaluating = mode in (RunningStage.VALIDATING, RunningStage.TESTING)
        if (
            evaluating
            and isinstance(dataloader, DataLoader)
            and (connector._requires_distributed_sampler(dataloader))
        ):
            sampler = UnrepeatedDistributedSamplerWrapper(
                dataloader.sampler, shuffle=False, **trainer.distributed_sampler_kwargs
            )
            return _update_dataloader(dataloader, sampler, mode=mode)
        return prepare(dataloader, shuffle=shuffle, mode=mode)

    return prepare_for_ring
