"""`DistributedOptimizer` for Keras 3: a step's gradients are averaged over every rank,
in one fused call, before they are clipped and applied.

The hook is the optimizer's ``_clip_gradients``, which Keras 3 calls once per update on
every backend, right before the update itself: after gradient accumulation (so the
``gradient_accumulation_steps - 1`` accumulating steps send nothing) and before
``clipnorm`` / ``global_clipnorm`` (so clipping sees averaged gradients).

Under ``mixed_float16`` Keras wraps the optimizer in a ``LossScaleOptimizer`` that skips the
inner update when this rank's gradients are not finite. A rank that skipped would leave the
others waiting in the collective, so for a loss-scale optimizer the reduction moves to its
``apply``, before the finiteness check: every rank then sees the same averaged gradients and
makes the same decision. `RingBroadcast` moves it there when ``compile()`` did the wrapping.

The optimizer keeps its class name and module, so a saved model loads with the plain
optimizer.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from typing import Any

import keras

from .. import core
from ..core.ops import Average, ReduceOp, as_op
from . import patches
from ._reduce import reduce_gradients
from .sharding import ShardedApply, _Shard, check_shardable

_IDS = itertools.count()


@dataclasses.dataclass
class _Settings:
    op: ReduceOp
    fp16: bool
    name: str
    enabled: bool = True
    warned_mixed: bool = False
    local: frozenset[int] = frozenset()  # ids of variables whose gradients stay local
    local_scale: float = 1.0  # what their gradients are multiplied by
    # The engine current when the optimizer was made (a process set's, inside its scope:
    # the gradients are reduced among its ranks); None: the world's.
    engine: Any = dataclasses.field(default_factory=lambda: core.runtime.scope.get())


class _ReduceBeforeClipping:
    """Mixed into a plain Keras optimizer's class."""

    _ringplug: _Settings

    def _filter_empty_gradients(self, grads: Any, variables: Any) -> Any:
        grads, variables = super()._filter_empty_gradients(grads, variables)  # type: ignore[misc]
        # Which variables _clip_gradients' grads belong to, as keys: a list of variables
        # here would be tracked as the optimizer's own (and saved with it).
        self._ringplug_keys = tuple(_key(v) for v in variables)
        return grads, variables

    def _clip_gradients(self, grads: list[Any]) -> list[Any]:
        settings = self._ringplug
        if settings.enabled:
            refuse_keras_distribution()  # set after the optimizer was made, or a scope
            _warn_if_loss_scaled_elsewhere(settings)
            grads = list(grads)
            local = _local_positions(self, settings, len(grads))
            shared = [None if i in local else g for i, g in enumerate(grads)]
            token = core.runtime.scope.set(settings.engine)
            try:
                reduced = reduce_gradients(
                    shared,
                    settings.op,
                    settings.name,
                    settings.fp16,
                    when=self._ringplug_update_step(),
                )
            finally:
                core.runtime.scope.reset(token)
            scale = settings.local_scale
            grads = [
                (g if scale == 1.0 else g * scale) if i in local else r
                for i, (g, r) in enumerate(zip(grads, reduced, strict=True))
            ]
        return super()._clip_gradients(grads)  # type: ignore[misc]

    def _ringplug_update_step(self) -> Any:
        """On JAX, gradient accumulation clips (and so reduces) on every micro-step and
        throws the result away on all but the last: there, reduce only on that last one."""
        steps = getattr(self, "gradient_accumulation_steps", None)
        if not steps or keras.backend.backend() != "jax":
            return None
        return (self._iterations + 1) % steps == 0  # type: ignore[attr-defined]


class _ReduceBeforeFinitenessCheck:
    """Mixed into a LossScaleOptimizer's class."""

    _ringplug: _Settings

    def apply(self, grads: list[Any], trainable_variables: Any = None) -> Any:
        return super().apply(self._ringplug_reduce(grads), trainable_variables)  # type: ignore[misc]

    def stateless_apply(
        self, optimizer_variables: Any, grads: list[Any], trainable_variables: Any
    ) -> Any:
        # The JAX backend's path.
        return super().stateless_apply(  # type: ignore[misc]
            optimizer_variables, self._ringplug_reduce(grads), trainable_variables
        )

    def _ringplug_reduce(self, grads: list[Any]) -> list[Any]:
        settings = self._ringplug
        if not settings.enabled:
            return list(grads)
        refuse_keras_distribution()
        token = core.runtime.scope.set(settings.engine)
        try:
            return reduce_gradients(list(grads), settings.op, settings.name, settings.fp16)
        finally:
            core.runtime.scope.reset(token)


def refuse_keras_distribution() -> None:
    """Raise when a ``keras.distribution`` (DataParallel, ModelParallel) is in force: with
    ringplug's optimizer that is two ways of splitting the batch and averaging at once."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return
    raise ValueError(
        f"keras.distribution is set ({type(distribution).__name__}) and the optimizer is "
        "ringplug's DistributedOptimizer: two data-parallel mechanisms at once (Keras's "
        "splits each batch over this process's devices, ringplug averages gradients over "
        "the ranks the launcher started), so the gradients would be averaged twice, over "
        "different sets. Use one. For ringplug: remove keras.distribution.set_distribution"
        "(...) (or the distribution.scope()) and start one rank per GPU with ringrun; "
        "ringplug.keras.init() gives each rank its GPU. For Keras's own: use the plain "
        "optimizer."
    )


def _warn_if_loss_scaled_elsewhere(settings: _Settings) -> None:
    if settings.warned_mixed or keras.config.dtype_policy().name != "mixed_float16":
        return
    settings.warned_mixed = True
    warnings.warn(
        "ringplug: a mixed_float16 policy is active and this DistributedOptimizer may sit "
        "inside the LossScaleOptimizer that compile() adds, where a rank with inf gradients "
        "skips the reduction and the others wait for it. Add ringplug.keras.RingBroadcast() "
        "to fit's callbacks (it moves the reduction), or wrap it yourself: "
        "DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer)).",
        stacklevel=3,
    )


def _class_for(base: type, zero: int = 0) -> type:
    if is_distributed_class(base):
        return base
    if zero:
        return patches.subclass_with(base, ShardedApply)
    loss_scaled = issubclass(base, keras.optimizers.LossScaleOptimizer)
    mixin = _ReduceBeforeFinitenessCheck if loss_scaled else _ReduceBeforeClipping
    return patches.subclass_with(base, mixin)  # refuses a Keras without the methods


def is_distributed_class(cls: type) -> bool:
    return issubclass(cls, (_ReduceBeforeClipping, _ReduceBeforeFinitenessCheck, ShardedApply))


def is_distributed(optimizer: Any) -> bool:
    """Whether `optimizer` (or, for a loss-scale optimizer, its inner one) reduces."""
    if getattr(optimizer, "_ringplug", None) is not None and optimizer._ringplug.enabled:
        return True
    inner = getattr(optimizer, "inner_optimizer", None)
    return inner is not None and is_distributed(inner)


def DistributedOptimizer(  # noqa: N802 - reads like a class, as in Horovod
    optimizer: keras.optimizers.Optimizer,
    op: ReduceOp | str = Average,
    backward_passes_per_step: int = 1,
    compression: str | None = None,
    zero: int = 0,
) -> keras.optimizers.Optimizer:
    """Make `optimizer` average its gradients over every rank before each update.

    Args:
        optimizer: a Keras 3 optimizer (or a ``LossScaleOptimizer``); changed in place and
            returned.
        op: ``Average`` (default) or ``Sum``.
        backward_passes_per_step: batches whose gradients accumulate locally before one
            reduction and one update; Keras's own ``gradient_accumulation_steps`` (set it
            here or there). Defaults to 1.
        compression: ``None`` (default) or ``"fp16"``: float gradients travel as float16.
        zero: ``0`` (default): every rank holds the whole optimizer state. ``1``: shard it
            (ZeRO stage 1): each trainable variable is dealt to one rank, whose optimizer
            alone holds its slots and updates it; the updated weights then go to every
            rank. Optimizer state per rank falls to about 1/ranks; the weights are the
            same as with ``0``. Saving needs `ringplug.keras.consolidate` first (or
            `BackupAndRestore`). See docs/bigger-models.md.

    Returns:
        The same optimizer object, now of a subclass of its class that keeps the class's
        name, so ``model.save`` writes (and loading gives) the plain optimizer.

    Raises:
        ValueError: a ``keras.distribution`` is set (now, or later when the gradients are
            reduced): one data-parallel mechanism at a time. With ``zero=1``: an optimizer
            that cannot be sharded (a LossScaleOptimizer, a MultiOptimizer, one with its own
            ``apply``, or one already built); the message says what to use instead.

    Example:
        >>> opt = ringplug.keras.DistributedOptimizer(  # doctest: +SKIP
        ...     keras.optimizers.SGD(ringplug.keras.scale_lr(0.01), momentum=0.9))
        >>> model.compile(optimizer=opt, loss="mse")
    """
    core.runtime.engine()  # fail early, with the right message, before init()
    refuse_keras_distribution()
    reduce_op = as_op(op)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError("DistributedOptimizer reduces gradients with Average or Sum.")
    if compression not in (None, "none", "fp16"):
        raise ValueError(f"compression must be None or 'fp16', not {compression!r}.")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be at least 1.")
    if zero not in (0, 1):
        raise ValueError(
            f"zero must be 0 (no sharding) or 1 (shard the optimizer state), got {zero!r}; "
            "Keras has no stage 2 in ringplug (its gradients are not kept between steps)."
        )
    if zero:
        check_shardable(optimizer)
    if backward_passes_per_step > 1:
        _set_accumulation(optimizer, backward_passes_per_step)
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and getattr(inner, "_ringplug", None) is not None:
        inner._ringplug.enabled = False  # the loss-scale wrapper reduces instead
    optimizer.__class__ = _class_for(type(optimizer), zero)
    optimizer._ringplug = _Settings(
        reduce_op, compression == "fp16", f"keras.gradients.{next(_IDS)}"
    )
    if zero:
        optimizer._ringplug_shard = _Shard()
    return optimizer


def _local_positions(optimizer: Any, settings: _Settings, count: int) -> set[int]:
    """Positions of the gradients that stay local (PartialDistributedOptimizer)."""
    if not settings.local:
        return set()
    keys = getattr(optimizer, "_ringplug_keys", None) or ()
    if len(keys) != count:
        return set()
    return {i for i, key in enumerate(keys) if key in settings.local}


def backend_variable(variable: Any) -> Any:
    """The variable that holds `variable`'s value: a Keras 3 variable's backend variable
    (its ``value`` property), else `variable` itself. Users name local variables by either
    (``layer.weights`` or a tape's sources), so both must match the same one."""
    if isinstance(getattr(type(variable), "value", None), property):
        return variable.value
    return variable


def _key(variable: Any) -> int:
    """Which variable a gradient is for, the same at every step: a Keras variable itself
    (on JAX its value is a new array after each assignment), else the variable that holds
    the value."""
    return id(variable) if isinstance(variable, keras.Variable) else id(backend_variable(variable))


variable_key = _key


def local_variable_keys(optimizer: Any) -> frozenset[int]:
    """The keys (`variable_key`) of the variables whose gradients `optimizer` (or the one a
    loss-scale optimizer wraps) keeps local."""
    found: frozenset[int] = frozenset()
    while optimizer is not None:
        settings = getattr(optimizer, "_ringplug", None)
        if settings is not None:
            found |= settings.local
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return found


def set_local_variables(optimizer: Any, variables: list[Any], scale: float = 1.0) -> None:
    """Keep the gradients of `variables` local to each rank (not averaged), multiplied by
    `scale`: for layers each rank trains on its own (model parallelism)."""
    settings = getattr(optimizer, "_ringplug", None)
    if settings is None:
        raise ValueError("set_local_variables needs a ringplug DistributedOptimizer.")
    if isinstance(optimizer, ShardedApply):
        raise ValueError(
            "Local variables (PartialDistributedOptimizer) and zero=1 do not mix: a sharded "
            "optimizer updates each variable on its owner only. Use zero=0 with local layers."
        )
    settings.local = frozenset(_key(v) for v in variables)
    settings.local_scale = float(scale)


def _set_accumulation(optimizer: Any, steps: int) -> None:
    target = getattr(optimizer, "inner_optimizer", optimizer)
    current = target.gradient_accumulation_steps
    if current == steps:
        return
    if current or target.built:
        raise ValueError(
            f"backward_passes_per_step={steps} disagrees with the optimizer's "
            f"gradient_accumulation_steps={current}"
            + (" (and the optimizer is already built)" if target.built else "")
            + "; set one of them, before the optimizer is built."
        )
    target.gradient_accumulation_steps = steps


def reduce_at_the_outermost(model: keras.Model) -> None:
    """Move the reduction to a LossScaleOptimizer that ``compile()`` wrapped around a
    DistributedOptimizer (see the module docstring)."""
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is None or getattr(optimizer, "_ringplug", None) is not None:
        return
    if isinstance(inner, ShardedApply):
        raise ValueError(
            "compile() wrapped a zero=1 DistributedOptimizer in a LossScaleOptimizer (the "
            "mixed_float16 policy), which zero=1 cannot shard: its inner update is skipped on "
            "non-finite gradients. Use the 'mixed_bfloat16' policy (no loss scaling) with "
            "zero=1, or zero=0 with mixed_float16."
        )
    settings = getattr(inner, "_ringplug", None)
    if settings is None or not settings.enabled:
        return
    optimizer.__class__ = _class_for(type(optimizer))
    optimizer._ringplug = dataclasses.replace(settings)
    settings.enabled = False
