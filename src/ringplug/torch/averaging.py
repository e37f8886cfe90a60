"""The mixin that averages an optimizer's gradients over ranks while backward is still
running (`ringplug.torch.DistributedOptimizer` builds the class; see that module).

Parameters are grouped into per-dtype buckets of about 25 MiB, in reverse registration
order (the order backward usually produces gradients in, so the first buckets fill early).
A post-accumulate-grad hook on each parameter marks it ready; when every parameter of a
bucket is ready, the bucket's gradients are reduced as one fused, in-place request while
autograd goes on with the layers below, and ``step()`` waits for the rest. Sharded state
(`ringplug.torch.zero`) builds on the same buckets.

The gradients are reduced where autograd put them: the ring reads and writes the gradient
tensors themselves, so there is no copy into a bucket buffer and none out of it (on a
memory-bound CPU that copy cost as much as a third of the ring). ``zero_grad()`` sets the
gradients to None as torch's does; fresh gradient tensors are what autograd hands over
cheapest.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .. import diagnose
from ..compression import Compression
from ..core import activity, runtime
from ..core.ops import ReduceOp
from .collectives import TensorHandle, allreduce_async_, grouped_allreduce_async_

DEFAULT_BUCKET_BYTES = 25 << 20
_OPTIMIZER_IDS = itertools.count()


class _Bucket:
    """Parameters of one dtype whose gradients are reduced together, as one request."""

    def __init__(self, index: int, params: list[torch.nn.Parameter]) -> None:
        self.index = index
        self.params = params
        self.pending = len(params)
        self.handle: TensorHandle | None = None
        self.grads: list[torch.Tensor] = []  # what is being reduced
        self.packed: torch.Tensor | None = None  # their float16 copy (fp16 compression)
        self.sparse: dict[int, int] = {}  # param index -> sparse_dim of its sparse gradient
        self.nbytes = sum(p.numel() * p.element_size() for p in params)  # on the wire, dense


class _Distributed:
    """Mixed into the user's optimizer class (see `DistributedOptimizer`)."""

    def _ringplug_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        backward_passes_per_step: int,
        compression: Compression,
        op: ReduceOp,
        gradient_predivide_factor: float,
        bucket_bytes: int,
    ) -> None:
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be at least 1.")
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError("DistributedOptimizer reduces gradients with Average or Sum.")
        if gradient_predivide_factor != 1.0 and op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor only applies to op=Average.")
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        names = {id(p): f"param.{i}" for i, p in enumerate(params)}
        if named_parameters is not None:
            given = {id(p): name for name, p in _checked_names(named_parameters)}
            missing = [names[id(p)] for p in params if id(p) not in given]
            if missing:
                raise ValueError(
                    f"named_parameters does not name {len(missing)} optimizer parameter(s); "
                    "pass model.named_parameters() of the model the optimizer was built on."
                )
            names = {id(p): given[id(p)] for p in params}
        self._ringplug_names = names
        # The engine current when the optimizer is built (a process set's, inside its
        # scope): its gradients are reduced among that engine's ranks, whichever thread
        # or scope backward and step() run in.
        self._ringplug_scope = runtime.scope.get()
        # Every rank builds its optimizers in the same order, so this names them alike.
        self._ringplug_prefix = f"gradients.{next(_OPTIMIZER_IDS)}"
        self._ringplug_passes = backward_passes_per_step
        self._ringplug_compression = compression
        self._ringplug_op = op
        self._ringplug_predivide = gradient_predivide_factor
        self._ringplug_counts: dict[int, int] = {id(p): 0 for p in params}
        # A world of one has nothing to reduce: no buckets, no hooks, plain steps.
        alone = runtime.size() == 1
        self._ringplug_buckets = (
            [] if alone else _make_buckets(list(reversed(params)), bucket_bytes)
        )
        self._ringplug_bucket_of: dict[int, _Bucket] = {}
        self._ringplug_hooks: list[Any] = []
        for bucket in self._ringplug_buckets:
            for p in bucket.params:
                self._ringplug_bucket_of[id(p)] = bucket
                self._ringplug_hooks.append(
                    p.register_post_accumulate_grad_hook(self._ringplug_hook)
                )
        self._ringplug_synchronized = False
        self._ringplug_skip = False
        # Set by a framework strategy: skip reducing during accumulation passes, and finish
        # the averaging before backward() returns (so hooks after it see averaged gradients).
        self._ringplug_blocked = False
        self._ringplug_sync_in_backward = False
        self._ringplug_callback_queued = False
        # Started with the last gradients of each step and finished with them: what else
        # rides in the same engine cycles (rank 0's buffers, `ringplug.torch.buffers`).
        self._ringplug_companions: list[Callable[[], Callable[[], None]]] = []

    # -------------------------------------------------------------- during backward
    def _ringplug_hook(self, param: torch.nn.Parameter) -> None:
        if self._ringplug_blocked:
            return
        if self._ringplug_sync_in_backward and not self._ringplug_callback_queued:
            self._ringplug_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._ringplug_end_backward)
        key = id(param)
        self._ringplug_counts[key] += 1
        if self._ringplug_counts[key] != self._ringplug_passes:
            return
        bucket = self._ringplug_bucket_of[key]
        bucket.pending -= 1
        if bucket.pending == 0 and bucket.handle is None:
            self._ringplug_start(bucket)

    def _ringplug_start(self, bucket: _Bucket) -> None:
        """Start the bucket's allreduce: in place on the gradients, or on a float16 copy."""
        token = runtime.scope.set(getattr(self, "_ringplug_scope", None))
        try:
            self._ringplug_submit(bucket)
        finally:
            runtime.scope.reset(token)

    def _ringplug_submit(self, bucket: _Bucket) -> None:
        for index, p in enumerate(bucket.params):
            if p.grad is None:  # no gradient this step: reduced as zeros, like every rank's
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                # Reduced dense (ranks touch different rows) and handed back sparse, for
                # the optimizers that need sparse gradients (SparseAdam).
                bucket.sparse[index] = p.grad.sparse_dim()
                p.grad = p.grad.to_dense()
        bucket.grads = [p.grad for p in bucket.params]
        clock = diagnose.active()
        if clock is not None:
            clock.reduction_started(time.perf_counter())
        average = self._ringplug_op is ReduceOp.AVERAGE
        scales = {
            "prescale_factor": 1.0 / self._ringplug_predivide if average else 1.0,
            "postscale_factor": self._ringplug_predivide if average else 1.0,
        }
        name = f"{self._ringplug_prefix}.{bucket.index}"
        if self._ringplug_compression is Compression.fp16 and bucket.grads[0].is_floating_point():
            bucket.packed = torch.cat([g.reshape(-1) for g in bucket.grads]).to(torch.float16)
            bucket.handle = allreduce_async_(bucket.packed, self._ringplug_op, name=name, **scales)
        else:
            bucket.handle = grouped_allreduce_async_(
                bucket.grads, self._ringplug_op, name=name, **scales
            )

    def _ringplug_end_backward(self) -> None:
        self._ringplug_callback_queued = False
        self.synchronize()

    # -------------------------------------------------------------- public API
    def synchronize(self) -> None:
        """Finish averaging every gradient, so that they can be inspected or clipped.

        Parameters that got no gradient this step are reduced as zeros, so every rank
        runs the same collectives.
        """
        clock = diagnose.active()
        if clock is not None:
            clock.backward_ended(time.perf_counter())  # what is left to wait for is exposed
        else:
            activity.set_phase(activity.REDUCING)
        nbytes = 0
        for bucket in self._ringplug_buckets:
            if bucket.handle is None:
                self._ringplug_start(bucket)
        finishers = [start() for start in self._ringplug_companions]
        for bucket in self._ringplug_buckets:
            nbytes += self._ringplug_finish(bucket)
        for finish in finishers:
            finish()
        for key in self._ringplug_counts:
            self._ringplug_counts[key] = 0
        self._ringplug_synchronized = True
        if clock is not None:
            clock.reduced(time.perf_counter(), nbytes)
        else:
            activity.set_phase(activity.STEPPING)

    def _ringplug_finish(self, bucket: _Bucket) -> int:
        """Wait for the bucket's reduction and put its gradients back; returns the bytes sent."""
        bucket.handle.wait()
        packed = bucket.packed
        nbytes = bucket.nbytes if packed is None else packed.numel() * packed.element_size()
        if bucket.packed is not None:
            offset = 0
            for grad in bucket.grads:
                grad.copy_(bucket.packed[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            bucket.packed = None
        for index, sparse_dim in bucket.sparse.items():
            param = bucket.params[index]
            param.grad = param.grad.to_sparse(sparse_dim)
        bucket.sparse = {}
        bucket.grads = []
        bucket.handle = None
        bucket.pending = len(bucket.params)
        return nbytes

    def detach_hooks(self) -> None:
        """Stop watching the parameters' gradients (when this optimizer is done with)."""
        for handle in self._ringplug_hooks:
            handle.remove()
        self._ringplug_hooks.clear()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Use when `synchronize()` was called by hand: `step()` inside won't call it again."""
        self._ringplug_skip = True
        try:
            yield
        finally:
            self._ringplug_skip = False

    def step(self, closure: Any = None) -> Any:
        if not self._ringplug_skip and not self._ringplug_synchronized:
            self.synchronize()
        self._ringplug_synchronized = False
        result = self._ringplug_local_step(closure)
        activity.count_step()  # the position's step (a framework sets it at each batch)
        clock = diagnose.active()
        if clock is not None:
            clock.step_ended()
        else:
            activity.set_phase(activity.BETWEEN_STEPS)
        return result

    def _ringplug_local_step(self, closure: Any) -> Any:
        """The wrapped optimizer's own step, on the averaged gradients."""
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, as torch's `zero_grad` (refused while they are being averaged).

        Keep the default ``set_to_none=True``: autograd then hands over fresh gradient
        tensors, which costs less than zeroing the old ones and adding into them (measured
        on an 84 MB model: a 1-rank step took 77 ms against 100 ms).
        """
        if any(bucket.handle is not None for bucket in self._ringplug_buckets):
            raise RuntimeError(
                "zero_grad() while gradients are still being averaged; call step() or "
                "synchronize() first (or set backward_passes_per_step for accumulation)."
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]


def _checked_names(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
) -> list[tuple[str, torch.nn.Parameter]]:
    """`named_parameters` as a list, refused unless (name, parameter) pairs of unique names."""
    pairs = list(named_parameters)
    if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
        raise ValueError(
            "named_parameters should be a sequence of (name, parameter) tuples, such as "
            "model.named_parameters()."
        )
    names = [name for name, _ in pairs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"named_parameters has duplicate names: {', '.join(duplicates)}. Give every "
            "parameter its own name."
        )
    return pairs


def _make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    """Group parameters (in the given order) into same-dtype buckets of about bucket_bytes."""
    buckets: list[_Bucket] = []
    current: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        group = current.setdefault(p.dtype, [])
        group.append(p)
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
        if sizes[p.dtype] >= bucket_bytes:
            buckets.append(_Bucket(len(buckets), group))
            current[p.dtype], sizes[p.dtype] = [], 0
    for group in current.values():
        if group:
            buckets.append(_Bucket(len(buckets), group))
    return buckets
