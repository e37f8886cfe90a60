"""Every change ringplug makes to the Trainer's own objects, in one place, each guarded by
`ringplug._patching` (a missing name is a warning and the fallback it states, never an
``AttributeError`` in the middle of a fit). `targets` lists them, for tests/test_patches.py.

At import (`ringplug` imports this module right after ``lightning.pytorch.trainer.trainer``
has run; mirrored for ``pytorch_lightning``; `RingStrategy` imports it only inside its
methods, since the strategy's own module loads while the Trainer's may still be half
initialised), under an MPI launcher that started N > 1 ranks
once the script has imported ringplug, the same rule as Fabric's
(`ringplug.fabric.patches`):

- a ``Trainer()`` left at the default ``strategy="auto"`` takes ``strategy="ring"``;
- a Trainer left with a one-process strategy (``SingleDeviceStrategy``) stops at once, saying
  what to change, instead of training N copies in silence.

During a fit, `RingStrategy` asks for the rest through the functions below: Lightning's
check of compiled models, its ``prepare_data`` and data preparation, its per-batch SIGTERM
broadcast and its SIGTERM flag, and (with sharded optimizer state) its clipping by norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as _package
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer import trainer as _trainer_module
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.trainer import Trainer

from .._patching import missing, wrap
from ..fabric.common import launched_ranks, one_copy_per_rank_error

_VERSION = f"{_package.__name__} {getattr(_package, '__version__', '?')}"
RING = "ring"  # RingStrategy.strategy_name (not imported: that module imports this one)


def targets() -> list[tuple[Any, str]]:
    """Every (owner, attribute) of Lightning's that this module may replace or wrap, and the
    internals RingStrategy calls."""
    return [
        (_DataConnector, "_requires_distributed_sampler"),
        (_AcceleratorConnector, "_choose_strategy"),
        (Trainer, "__init__"),
        (_trainer_module, "_verify_strategy_supports_compile"),
        (_DataConnector, "prepare_data"),
        (_DataConnector, "_prepare_dataloader"),
        (_FitLoop, "setup_data"),
        (_TrainingEpochLoop, "_broadcast_sigterm_tensor"),
        (_SignalConnector, "_sigterm_notifier_fn"),
        (Precision, "clip_grad_by_norm"),
    ]


# ------------------------------------------------------------------ at import
def _choose_strategy(original: Callable[..., Any]) -> Callable[..., Any]:
    def choose(self: Any) -> Any:
        choice = original(self)
        # Under an MPI launcher the ranks exist already: Lightning's choice (one device,
        # or DDP over devices it would count itself) gives way to the ring.
        if launched_ranks() > 1:
            return RING
        return choice

    return choose


def _init(original: Callable[..., Any]) -> Callable[..., Any]:
    def init(self: Trainer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        ranks = launched_ranks()
        if ranks > 1 and (isinstance(self.strategy, SingleDeviceStrategy) or self.world_size == 1):
            raise one_copy_per_rank_error("Trainer", self.strategy, ranks)

    return init


wrap(
    _AcceleratorConnector,
    "_choose_strategy",
    _choose_strategy,
    version=_VERSION,
    fallback="under ringrun, pass Trainer(strategy='ring'): the default strategy is left "
    "to Lightning, and a Trainer of one process is refused",
)
wrap(
    Trainer,
    "__init__",
    _init,
    version=_VERSION,
    fallback="a Trainer of one process under ringrun is not detected",
)


# ------------------------------------------------------------------ during a fit
def allow_compiled_models(strategy_class: type) -> None:
    """Let ``trainer.fit(torch.compile(model))`` run under `strategy_class` (RingStrategy).

    Lightning unwraps a compiled model and compiles the LightningModule's forward again,
    whatever the strategy, then checks the strategy against a fixed list (single device,
    DDP, FSDP). RingStrategy, like DDP, only averages gradients, so it is let through; every
    other strategy still gets Lightning's check.
    """

    def make(check: Callable[..., Any]) -> Callable[..., Any]:
        def verify(model: Any, strategy: Any) -> None:
            if not isinstance(strategy, strategy_class):
                check(model, strategy)

        return verify

    wrap(
        _trainer_module,
        "_verify_strategy_supports_compile",
        make,
        version=_VERSION,
        quiet=True,  # a Lightning without the check lets every strategy compile
        fallback="nothing to let through",
    )


def around_prepare_data(trainer: Any, before: Callable[[], None], after: Callable[[], None]):
    """Run `before` and `after` around Lightning's ``prepare_data`` in this fit."""

    def make(prepare: Callable[[], None]) -> Callable[[], None]:
        def prepare_data() -> None:
            before()
            try:
                prepare()
            finally:
                after()

        return prepare_data

    wrap(
        trainer._data_connector,
        "prepare_data",
        make,
        version=_VERSION,
        again=True,
        fallback="a rank in prepare_data is reported as waiting in a barrier",
    )


def before_each_epoch(trainer: Any, hook: Callable[[Any], None]) -> None:
    """Call ``hook(fit_loop)`` before Lightning prepares the training data of each epoch
    (``fit_loop.setup_data``, which returns at once unless the loader is to be made
    again)."""

    def make(setup_data: Callable[[], None]) -> Callable[[], None]:
        def setup_data_for_ring() -> None:
            hook(fit_loop)
            setup_data()

        return setup_data_for_ring

    fit_loop = trainer.fit_loop
    wrap(
        fit_loop,
        "setup_data",
        make,
        version=_VERSION,
        again=True,
        fallback="a fit resumed mid-epoch restarts the epoch",
    )


def replace_prepare_dataloader(
    trainer: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> bool:
    """Replace how the Trainer prepares each dataloader by ``make(lightnings_own)``."""
    return wrap(
        trainer._data_connector,
        "_prepare_dataloader",
        make,
        version=_VERSION,
        again=True,
        fallback="Lightning's DistributedSampler is used as it is (evaluation pads ranks with "
        "repeated samples, and a fit resumed mid-epoch restarts the epoch)",
    )


def replace_sigterm_broadcast(trainer: Any, check: Callable[[], None]) -> None:
    """Lightning's per-batch broadcast of the SIGTERM flag becomes `check` (the batch
    agreement already carries every rank's flag)."""
    wrap(
        trainer.fit_loop.epoch_loop,
        "_broadcast_sigterm_tensor",
        lambda _broadcast: lambda: check(),
        version=_VERSION,
        again=True,
        quiet=True,  # Lightning before 2.5.2 broadcasts nothing per batch: nothing to replace
        fallback="nothing to replace",
    )


def agree_on_sigterm(connector: Any, mixin: type) -> bool:
    """Mix `mixin` into Lightning's signal connector (its class, for this object only), so
    that ``received_sigterm`` and the SIGTERM handler are the ranks' agreed flag. False
    (with a warning) where the connector lacks the handler that `mixin` overrides."""
    if isinstance(connector, mixin):
        return True
    if missing(
        connector,
        "_sigterm_notifier_fn",
        version=_VERSION,
        fallback="a SIGTERM stops only the rank that received it",
    ):
        return False
    connector.__class__ = type(f"Agreed{type(connector).__name__}", (mixin, type(connector)), {})
    return True


def clip_norm_over_shards(precision_plugin: Any, sharded: type) -> None:
    """Lightning's clipping by norm (the precision plugin's ``clip_grad_by_norm``, which
    ``Trainer(gradient_clip_val=...)`` and ``LightningModule.clip_gradients`` reach), for an
    optimizer of class `sharded`, becomes the optimizer's ``clip_grad_norm_``: the norm over
    every rank's shard of the gradients (Lightning's own sums over the gradients this rank
    holds, with zero=2 its shard only). Other optimizers keep Lightning's."""

    def make(clip: Callable[..., Any]) -> Callable[..., Any]:
        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            if isinstance(inner, sharded):
                inner.clip_grad_norm_(clip_val)
            else:
                clip(optimizer, clip_val)

        return clip_grad_by_norm

    wrap(
        precision_plugin,
        "clip_grad_by_norm",
        make,
        version=_VERSION,
        again=True,
        fallback="with zero=2, clipping by norm takes the norm of this rank's shard of the "
        "gradients only: clip with optimizer.clip_grad_norm_ in configure_gradient_clipping",
    )
