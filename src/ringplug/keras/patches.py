"""Every change ringplug makes to Keras's own objects, in one place, each checked against
what it relies on: `targets` lists those names, for tests/test_patches.py.

- `DistributedOptimizer` gives the user's optimizer a class of its own, the optimizer's class
  with a ringplug mixin that overrides some of Keras's optimizer methods (the gradients are
  reduced in them). A Keras without one of those methods would never call the override, and
  the ranks would each step with their own gradients, silently (Horovod on Keras 3): so
  `subclass_with` refuses such a Keras, naming the method.
- `RingBroadcast` turns Keras's own ``BackupAndRestore`` into ringplug's, in place
  (`adopt`), and finds it on the ``CallbackList`` that is calling ``on_train_begin``
  (`calling_callback_list`): Keras shows a callback no other callback.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import keras

from .._patching import absent

_VERSION = f"keras {keras.__version__}"


def overridden(mixin: type) -> list[str]:
    """The methods of Keras's that `mixin` overrides (ringplug's own start with _ringplug)."""
    return sorted(
        name
        for name, value in vars(mixin).items()
        if callable(value) and not name.startswith(("_ringplug", "__"))
    )


# What ringplug's mixins and subclasses override (tests/test_patches.py keeps these lists
# and the classes in step; this module must not import them: they import it).
OPTIMIZER_OVERRIDES = ("_clip_gradients", "_filter_empty_gradients")  # _ReduceBeforeClipping
LOSS_SCALE_OVERRIDES = ("apply", "stateless_apply")  # _ReduceBeforeFinitenessCheck
SHARDED_OVERRIDES = (  # sharding.ShardedApply (zero=1)
    "_clip_gradients",
    "apply",
    "build",
    "finalize_variable_values",
    "load_own_variables",
    "save_own_variables",
    "stateless_apply",
)
BACKUP_OVERRIDES = (  # ringplug.keras.BackupAndRestore's hooks
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_train_begin",
    "on_train_end",
)


def targets() -> list[tuple[Any, str]]:
    """Every (owner, attribute) of Keras's that ringplug overrides or calls."""
    optimizer, loss_scaled = keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer
    backup = keras.callbacks.BackupAndRestore
    return [
        *[(optimizer, name) for name in OPTIMIZER_OVERRIDES],
        *[(loss_scaled, name) for name in LOSS_SCALE_OVERRIDES],
        *[(optimizer, name) for name in SHARDED_OVERRIDES],
        # zero=1 relies on these inside Keras's own apply, build and saving:
        (optimizer, "_overwrite_model_variables_with_average_value"),
        (optimizer, "_backend_apply_gradients"),
        *[(backup, name) for name in BACKUP_OVERRIDES],
        (keras.callbacks.CallbackList, "on_train_begin"),
    ]


def subclass_with(base: type, mixin: type) -> type:
    """`base` (a Keras optimizer class) with `mixin` first among its bases, keeping base's
    name and module, so that saving writes the original class.

    Raises:
        RuntimeError: `base` lacks a method that `mixin` overrides: with this Keras the
            gradients would not be reduced.
    """
    lacking = absent([(base, name) for name in overridden(mixin)])
    if lacking:
        raise RuntimeError(
            f"ringplug.keras.DistributedOptimizer reduces the gradients inside "
            f"{', '.join(lacking)}, which {_VERSION} does not have: the ranks would each "
            f"step with their own gradients. Install a Keras that ringplug supports "
            f"(pip install 'ringplug[keras]' gives one), or report this with your Keras version."
        )
    return type(
        base.__name__,
        (mixin, base),
        {"__module__": base.__module__, "__qualname__": base.__qualname__},
    )


def adopt(callback: Any, cls: type) -> bool:
    """Make `callback`, one of Keras's own, an instance of `cls` (ringplug's subclass of its
    class), in place: same settings, same files, same place in the list. False where
    `cls` overrides a hook that Keras's class no longer has."""
    base = type(callback)
    if absent([(base, name) for name in overridden(cls) if name.startswith("on_")]):
        return False
    callback.__class__ = cls
    return True


def calling_callback_list(frame: FrameType | None, depth: int = 8) -> Any:
    """The ``keras.callbacks.CallbackList`` whose method is running at most `depth` frames
    above `frame`, or None (another Keras calls its callbacks differently: ringplug then
    leaves Keras's own callbacks as they are)."""
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList):
            return owner
        frame = frame.f_back
    return None


def caller(levels: int) -> FrameType | None:
    """The frame `levels` above the caller of this function."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(levels):
        frame = frame.f_back if frame is not None else None
    return frame
