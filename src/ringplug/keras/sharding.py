"""Sharded optimizer state for Keras 3 (ZeRO stage 1): ``DistributedOptimizer(..., zero=1)``.

Each trainable variable has one owner rank, dealt out whole, largest first, each to the rank
that holds the fewest bytes so far: the deal of `ringplug.torch`'s ZeRO, the same on every
rank. The optimizer is built on the variables this rank owns only, so its slots (momentum,
Adam's moments, EMA averages, gradient accumulators) exist for its shard alone. A step:

1. every gradient is averaged over the ranks, as without sharding (one fused allreduce);
2. each rank applies the optimizer to the variables it owns (clipping, weight decay,
   accumulation, EMA: Keras's own code, on the shard); ``global_clipnorm`` takes the norm
   over the whole model's gradients (one allreduce of one number);
3. the updated weights go from their owners to every rank (one allgather per dtype).

All three run inside the backend's train step (a stateful graph op on TensorFlow, eager on
torch, ordered ``io_callback`` inside the jitted step on JAX). With gradient accumulation the
gradients are averaged on every batch (the owner accumulates its share of the averages) and
the weights are gathered on update steps only.

Saving: the optimizer's variables differ from rank to rank, so a saved file holds the
*consolidated* state, laid out as the plain optimizer's (``keras.models.load_model`` in one
process gives a plain optimizer with the whole state). `consolidate` collects it on one rank
(call it on every rank, then save there); `ringplug.keras.BackupAndRestore` does so itself.
Loading a whole state (saved by any number of ranks, sharded or not) keeps each rank's share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np

from .. import core
from ..core.ops import ReduceOp
from ..sharding import partition
from ._reduce import reduce_gradients


@dataclasses.dataclass
class _Shard:
    """What one rank knows of the deal (kept out of Keras's variable tracking)."""

    variables: list[Any] = dataclasses.field(default_factory=list)  # every trainable one
    owners: list[int] = dataclasses.field(default_factory=list)
    mine: list[int] = dataclasses.field(default_factory=list)  # positions this rank owns
    others: list[int] = dataclasses.field(default_factory=list)  # and those it does not
    shared: list[Any] = dataclasses.field(default_factory=list)  # iterations, LR: everywhere
    groups: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)  # by dtype
    consolidated: list[np.ndarray] | None = None  # the whole state, on the rank it went to
    consolidated_at: int | None = None  # at which iterations value
    loaded: dict[str, np.ndarray] | None = None  # a whole state loaded here, by path


def check_shardable(optimizer: Any) -> None:
    """Refuse an optimizer that `zero=1` cannot shard, saying what to use instead."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "zero=1 cannot shard a LossScaleOptimizer: its inner optimizer's update is skipped "
            "on non-finite gradients, and its scale is state that every rank must share. Use "
            "zero=0 for mixed_float16, or train with the 'mixed_bfloat16' policy (no loss "
            "scaling) and zero=1."
        )
    if type(optimizer).__name__ == "MultiOptimizer" or hasattr(optimizer, "optimizer_map"):
        raise ValueError(
            "zero=1 cannot shard a MultiOptimizer (several optimizers, each with its own "
            "variables). Use zero=0 with it, or one optimizer with zero=1."
        )
    custom = [
        name
        for name in ("apply", "stateless_apply", "_backend_apply_gradients")
        if _defined_outside_keras(type(optimizer), name)
    ]
    if custom:
        raise ValueError(
            f"zero=1 cannot shard {type(optimizer).__name__}: it defines its own "
            f"{', '.join(custom)}, which may look at every variable at once, where a sharded "
            "optimizer is built on, and applied to, this rank's variables only. Use zero=0, "
            "or an optimizer that updates each variable on its own in update_step (SGD, Adam, "
            "AdamW, ... or a subclass that overrides only build, making its slots with "
            "add_variable_from_reference, and update_step)."
        )
    if isinstance(optimizer, keras.optimizers.Adafactor):
        raise ValueError(
            "zero=1 cannot shard Adafactor: its factored moments are named after each "
            "variable's short name ('kernel', 'bias'), so the shards of several layers cannot "
            "be told apart when the whole state is saved or loaded. Use zero=0 with "
            "Adafactor, or Adam/AdamW with zero=1."
        )
    if getattr(optimizer, "built", False):
        raise ValueError(
            "zero=1 deals the variables out when the optimizer is built, and this one is "
            "built already. Wrap the optimizer before compile() or fit() builds it."
        )


def _defined_outside_keras(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if name in vars(klass):
            module = klass.__module__ or ""
            return not (module.startswith("keras") or module.startswith("ringplug"))
    return False


def is_sharded(optimizer: Any) -> bool:
    """Whether `optimizer` is a ``zero=1`` DistributedOptimizer."""
    return isinstance(optimizer, ShardedApply)


def shared_variables(optimizer: Any) -> list[Any]:
    """The optimizer's variables that hold the same values on every rank: all of them,
    except a sharded optimizer's slots (each rank has its own shard's)."""
    if optimizer is None:
        return []
    if not is_sharded(optimizer) or not optimizer.built:
        return list(optimizer.variables)
    ids = {id(v) for v in optimizer._ringplug_shard.shared}
    return [v for v in optimizer.variables if id(v) in ids]


def _itemsize(dtype: Any) -> int:
    name = keras.backend.standardize_dtype(dtype)
    try:
        return np.dtype(name).itemsize
    except TypeError:  # bfloat16 and friends: not numpy's
        return 2 if "16" in name else 4


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


class ShardedApply:
    """Mixed into a Keras optimizer's class for ``zero=1``: built on this rank's shard,
    applied to it, and the updated weights gathered to every rank."""

    _ringplug: Any  # optimizer._Settings
    _ringplug_shard: _Shard

    # ------------------------------------------------------------------ build
    def build(self, variables: Any) -> None:
        if self.built:  # type: ignore[attr-defined]
            return
        if keras.config.dtype_policy().name == "mixed_float16":
            # compile() wraps this optimizer in a LossScaleOptimizer under this policy.
            raise ValueError(
                "zero=1 cannot run under the mixed_float16 policy: compile() wraps the "
                "optimizer in a LossScaleOptimizer, whose inner update is skipped on a rank's "
                "non-finite gradients. Use the 'mixed_bfloat16' policy (no loss scaling) with "
                "zero=1, or zero=0 with mixed_float16."
            )
        shard = self._ringplug_shard
        variables = list(variables)
        rank, size = core.rank(), core.size()
        shard.variables = variables
        shard.owners = partition(
            [int(np.prod(v.shape, dtype=np.int64)) * _itemsize(v.dtype) for v in variables], size
        )
        shard.mine = [i for i, owner in enumerate(shard.owners) if owner == rank]
        shard.others = [i for i, owner in enumerate(shard.owners) if owner != rank]
        shard.shared = list(self.variables)  # type: ignore[attr-defined]
        groups: dict[str, list[int]] = {}
        for index, variable in enumerate(variables):
            groups.setdefault(keras.backend.standardize_dtype(variable.dtype), []).append(index)
        shard.groups = list(groups.items())
        super().build([variables[i] for i in shard.mine])  # type: ignore[misc]

    # ------------------------------------------------------------------ step
    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        shard = self._ringplug_shard
        if trainable_variables is not None and not self.built:  # type: ignore[attr-defined]
            with keras.name_scope(self.name, caller=self):  # type: ignore[attr-defined]
                self.build(list(trainable_variables))
            self.built = True
        if not self.built:  # type: ignore[attr-defined]
            raise ValueError(
                "A sharded optimizer applied without variables must be built first: call "
                "optimizer.build(model.trainable_variables)."
            )
        if trainable_variables is not None:
            _check_same_variables(shard, list(trainable_variables))
        grads = list(grads)
        settings = self._ringplug
        if settings.enabled and core.size() > 1:
            grads = reduce_gradients(grads, settings.op, settings.name, settings.fp16)
        own_grads = [grads[i] for i in shard.mine]
        own_vars = [shard.variables[i] for i in shard.mine]
        if any(g is not None for g in own_grads):
            super().apply(own_grads, own_vars)  # type: ignore[misc]
        else:  # nothing to update here, but the ranks' collectives and counters stay alike
            self._ringplug_idle_step()
        if core.size() > 1:
            self._ringplug_gather(when=self._ringplug_after_update())

    def stateless_apply(
        self, optimizer_variables: Any, grads: Any, trainable_variables: Any
    ) -> Any:
        # The JAX trainer's path: every trainable variable in and out, this rank's slots.
        shard = self._ringplug_shard
        if not self.built:  # type: ignore[attr-defined]
            raise ValueError(
                "To call stateless_apply, the optimizer must be built: "
                "optimizer.build(model.trainable_variables)."
            )
        mine = list(self.variables)  # type: ignore[attr-defined]
        mapping = list(zip(shard.variables, trainable_variables, strict=True)) + list(
            zip(mine, optimizer_variables, strict=True)
        )
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self.apply(grads)
        return (
            [scope.get_current_value(v) for v in shard.variables],
            [scope.get_current_value(v) for v in mine],
        )

    def _clip_gradients(self, grads: list[Any]) -> list[Any]:
        clip = self.global_clipnorm  # type: ignore[attr-defined]
        if not clip or clip <= 0 or core.size() == 1:
            return super()._clip_gradients(grads)  # type: ignore[misc]
        ops = keras.ops
        present = [g for g in grads if g is not None]
        local = ops.sum(ops.stack([ops.sum(ops.square(ops.cast(g, "float32"))) for g in present]))
        norm = ops.sqrt(self._ringplug_norm_sum(local))
        # Keras's clip_by_global_norm, with the norm over every rank's shard.
        scale = clip * ops.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        return [g * ops.cast(scale, g.dtype) if g is not None else g for g in grads]

    def finalize_variable_values(self, var_list: Any) -> None:
        """EMA's end of training: owners write their averages, then every rank gets them."""
        if not self.use_ema:  # type: ignore[attr-defined]
            return
        shard = self._ringplug_shard
        owned = [shard.variables[i] for i in shard.mine]
        if owned:
            self._overwrite_model_variables_with_average_value(owned)  # type: ignore[attr-defined]
        if core.size() > 1:
            gather_eagerly(self)

    # ------------------------------------------------------------------ saving
    def save_own_variables(self, store: Any) -> None:
        """The whole state, as the plain optimizer lays it out (see `consolidate`)."""
        if core.size() == 1 or not self.built:  # type: ignore[attr-defined]
            super().save_own_variables(store)  # type: ignore[misc]
            return
        shard = self._ringplug_shard
        if shard.consolidated is None or shard.consolidated_at != _steps(self):
            raise RuntimeError(
                f"This optimizer's state is sharded over {core.size()} ranks (zero=1), so one "
                "rank cannot save it alone. Call ringplug.keras.consolidate(model.optimizer, "
                "to=RANK) on every rank, then save on RANK (before the next step); or save "
                "with ringplug.keras.BackupAndRestore, which does so itself."
            )
        for index, value in enumerate(shard.consolidated):
            store[str(index)] = value

    def load_own_variables(self, store: Any) -> None:
        """Load a whole state (written by the plain optimizer, or consolidated from any
        number of ranks): this rank keeps its shard of it."""
        if not self.built:  # type: ignore[attr-defined]
            super().load_own_variables(store)  # type: ignore[misc]
            return
        whole = _plain_twin(self)
        if len(store.keys()) != len(whole.variables):
            raise ValueError(
                f"The saved optimizer '{self.name}' has {len(store.keys())} variables, but "  # type: ignore[attr-defined]
                f"{type(self).__name__} built on this model has {len(whole.variables)} "
                "(unsharded): it was saved for another model or another optimizer setting."
            )
        loaded = {v.path: np.asarray(store[str(i)]) for i, v in enumerate(whole.variables)}
        adopt(self, loaded)
        self._ringplug_shard.loaded = loaded

    # ------------------------------------------------------------------ ringplug's own
    def _ringplug_update_step(self) -> Any:
        """Before the update: whether this batch ends an accumulation (None: every one)."""
        steps = self.gradient_accumulation_steps  # type: ignore[attr-defined]
        if not steps:
            return None
        return (self._iterations + 1) % steps == 0  # type: ignore[attr-defined]

    def _ringplug_after_update(self) -> Any:
        """After the update (the counter moved on): whether the weights changed."""
        steps = self.gradient_accumulation_steps  # type: ignore[attr-defined]
        if not steps:
            return None
        return self._iterations % steps == 0  # type: ignore[attr-defined]

    def _ringplug_norm_sum(self, local: Any) -> Any:
        """The sum of every rank's `local` (a float32 scalar); JAX: only on update steps."""
        when = self._ringplug_update_step() if keras.backend.backend() == "jax" else None
        name = f"{self._ringplug.name}.norm"
        summed = reduce_gradients([keras.ops.reshape(local, (1,))], ReduceOp.SUM, name, False, when)
        return keras.ops.reshape(summed[0], ())

    def _ringplug_idle_step(self) -> None:
        """A rank that owns no variable (or none with a gradient): it joins the norm's
        allreduce where the others clip, and counts the step."""
        if self.global_clipnorm and self.global_clipnorm > 0 and core.size() > 1:  # type: ignore[attr-defined]
            zero = keras.ops.zeros((), "float32")
            update = self._ringplug_update_step()
            if update is None or keras.backend.backend() == "jax":
                self._ringplug_norm_sum(zero)
            else:
                keras.ops.cond(update, lambda: self._ringplug_norm_sum(zero), lambda: zero)
        self._iterations.assign_add(1)  # type: ignore[attr-defined]

    def _ringplug_gather(self, when: Any) -> None:
        """Every owner's current weights to every rank (inside the train step)."""
        shard = self._ringplug_shard
        owned = [shard.variables[i].value for i in shard.mine]
        current = [shard.variables[i].value for i in shard.others]
        values = _gather(shard, self._ringplug.name, owned, current, when)
        for index, value in zip(shard.others, values, strict=True):
            shard.variables[index].assign(value)


def _check_same_variables(shard: _Shard, variables: list[Any]) -> None:
    if len(variables) == len(shard.variables) and all(
        a is b for a, b in zip(variables, shard.variables, strict=True)
    ):
        return
    raise ValueError(
        f"This sharded optimizer was built on {len(shard.variables)} variables and dealt them "
        f"to the ranks; it was now given {len(variables)} others. Apply it to the variables "
        "it was built with (model.trainable_variables), or make a new optimizer."
    )


def _steps(optimizer: Any) -> int:
    return int(_numpy(optimizer._iterations))


# ---------------------------------------------------------------------- weights gather
def gather_numpy(shard: _Shard, owned: list[np.ndarray], name: str) -> list[np.ndarray]:
    """The values of the variables this rank does not own, from their owners (one
    allgather per dtype; `owned` in the order of ``shard.mine``)."""
    rank = core.rank()
    by_index = dict(zip(shard.mine, owned, strict=True))
    results: dict[int, np.ndarray] = {}
    handles = []
    for dtype, indices in shard.groups:
        parts = [np.asarray(by_index[i]).reshape(-1) for i in indices if shard.owners[i] == rank]
        flat = np.concatenate(parts) if parts else np.empty(0, np.dtype(dtype))
        handles.append((indices, core.allgather_async(flat, name=f"{name}.weights.{dtype}")))
    for indices, handle in handles:
        gathered = np.asarray(handle.wait())
        offset = 0
        for owner in range(core.size()):
            for i in indices:
                if shard.owners[i] != owner:
                    continue
                shape = tuple(shard.variables[i].shape)
                count = int(np.prod(shape, dtype=np.int64))
                if owner != rank:
                    results[i] = gathered[offset : offset + count].reshape(shape)
                offset += count
    return [results[i] for i in sorted(results)]


def _gather(shard: _Shard, name: str, owned: list[Any], current: list[Any], when: Any) -> list[Any]:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return _gather_tensorflow(shard, name, owned, current, when)
    if backend == "torch":
        if when is not None and not bool(when):
            return current
        arrays = [o.detach().cpu().numpy() for o in owned]
        return [
            keras.ops.convert_to_tensor(v, dtype=c.dtype)
            for v, c in zip(gather_numpy(shard, arrays, name), current, strict=True)
        ]
    if backend == "jax":
        return _gather_jax(shard, name, owned, current, when)
    raise NotImplementedError(
        f"zero=1 supports the tensorflow, torch and jax backends, not {backend!r}."
    )


def _gather_tensorflow(
    shard: _Shard, name: str, owned: list[Any], current: list[Any], when: Any
) -> list[Any]:
    import tensorflow as tf

    from ..tensorflow import _ops

    token = tf.zeros((1,), tf.int32)  # no rank's op is without inputs or outputs

    def gathered() -> list[Any]:
        outputs = _ops.run(
            "Allgather",
            lambda _, *arrays: _ops.computed(
                [np.zeros((1,), np.int32), *gather_numpy(shard, list(arrays[1:]), name)]
            ),
            [token, *owned],
            [tf.int32, *[c.dtype for c in current]],
            [(1,), *[c.shape for c in current]],
            f"{name}.weights",
        )
        return list(outputs[1:])

    if when is None:
        return gathered()
    if not current:  # nothing to receive; the collective still runs on update steps
        tf.cond(when, lambda: gathered() or [token], lambda: [token])
        return []
    return list(tf.cond(when, gathered, lambda: [tf.identity(c) for c in current]))


def _gather_jax(
    shard: _Shard, name: str, owned: list[Any], current: list[Any], when: Any
) -> list[Any]:
    import jax
    from jax.experimental import io_callback

    token = jax.numpy.zeros((1,), "int32")
    shapes = [jax.ShapeDtypeStruct((1,), "int32")] + [
        jax.ShapeDtypeStruct(c.shape, c.dtype) for c in current
    ]

    def run(*arrays: Any) -> list[np.ndarray]:
        values = gather_numpy(shard, [np.asarray(a) for a in arrays[1:]], name)
        return [
            np.zeros((1,), np.int32),
            *[np.asarray(v, s.dtype) for v, s in zip(values, shapes[1:], strict=True)],
        ]

    def gathered(values: list[Any]) -> list[Any]:
        return list(io_callback(run, shapes, token, *values, ordered=True))[1:]

    if when is None:
        return gathered(owned)
    return jax.lax.cond(when, lambda: gathered(owned), lambda: list(current))


def gather_eagerly(optimizer: Any) -> None:
    """Outside a train step (every rank calls it): every variable gets its owner's value."""
    shard = optimizer._ringplug_shard
    owned = [_numpy(shard.variables[i]) for i in shard.mine]
    values = gather_numpy(shard, owned, optimizer._ringplug.name)
    for index, value in zip(shard.others, values, strict=True):
        shard.variables[index].assign(value)


# ---------------------------------------------------------------------- whole state
def _plain_twin(optimizer: Any) -> Any:
    """The plain optimizer of the same class and settings, built on every variable: whose
    layout a whole state has. Its variables take the memory of an unsharded state while it
    lives (on the rank that saves or loads, for that moment)."""
    plain = type(optimizer).__bases__[-1]
    twin = plain.from_config(optimizer.get_config())
    twin.build(optimizer._ringplug_shard.variables)
    paths = [v.path for v in twin.variables]
    if len(set(paths)) != len(paths):
        repeated = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(
            f"{plain.__name__} gives several of its variables the same name "
            f"({', '.join(repeated[:3])}), so a sharded state cannot be put together or "
            "taken apart by name. Use zero=0 with this optimizer."
        )
    return twin


def consolidate(optimizer: Any, to: int = 0) -> None:
    """Collect a ``zero=1`` optimizer's whole state on rank `to` (every rank calls it), so
    that saving there (``model.save``, ``save_weights``) writes it, laid out as the plain
    optimizer's: a file that ``keras.models.load_model`` loads in one process, and that a
    run on any number of ranks resumes from. Valid until the next step. Each shard travels
    to every rank once (an object allgather); the other ranks drop what they receive.

    Example:
        >>> ringplug.keras.consolidate(model.optimizer)  # doctest: +SKIP
        >>> if ringplug.rank() == 0:
        ...     model.save("model.keras")
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not is_sharded(inner):
        return  # every rank holds the whole state already
    if not inner.built:
        return
    shard = inner._ringplug_shard
    shared = {id(v) for v in shard.shared}
    mine = {v.path: _numpy(v) for v in inner.variables if id(v) not in shared}
    everyone = core.allgather_object(
        (bool(shard.mine), mine), name=f"{inner._ringplug.name}.consolidate"
    )
    if core.rank() != to:
        shard.consolidated = None
        return
    found: dict[str, np.ndarray] = {v.path: _numpy(v) for v in shard.shared}
    # Ranks that own variables first: a variable that is not a slot (Nadam's running
    # product) moves only on the ranks that step.
    for _, part in sorted(everyone, key=lambda entry: not entry[0]):
        for path, value in part.items():
            found.setdefault(path, value)
    twin = _plain_twin(inner)
    missing = [v.path for v in twin.variables if v.path not in found]
    if missing:
        raise RuntimeError(
            f"ringplug could not place {len(missing)} variables of {type(inner).__name__} "
            f"in its whole state (first: {missing[0]}): no rank holds one of that path."
        )
    shard.consolidated = [found[v.path] for v in twin.variables]
    shard.consolidated_at = _steps(inner)


def adopt(optimizer: Any, whole: dict[str, np.ndarray]) -> None:
    """Give `optimizer`'s variables (this rank's shard and the shared ones) their values
    from `whole`, a whole state by variable path."""
    for variable in optimizer.variables:
        value = whole.get(variable.path)
        if value is None:
            raise ValueError(
                f"The loaded optimizer state has no variable '{variable.path}': it was "
                "saved for another model or another optimizer."
            )
        variable.assign(value)


def distribute_loaded(optimizer: Any, root_rank: int = 0) -> None:
    """After rank `root_rank` loaded a whole state into a ``zero=1`` optimizer, every rank
    takes its shard of it (every rank calls it; one object broadcast)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not is_sharded(inner) or core.size() == 1:
        return
    shard = inner._ringplug_shard
    whole = shard.loaded if core.rank() == root_rank else None
    whole = core.broadcast_object(whole, root_rank, name=f"{inner._ringplug.name}.loaded")
    shard.loaded = None
    if whole is not None:
        adopt(inner, whole)
