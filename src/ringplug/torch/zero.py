"""Sharded optimizer state (ZeRO stages 1 and 2): ``DistributedOptimizer(..., zero=1 or 2)``.

Each trainable parameter has one owner rank. The parameters are dealt out whole, largest
first, each to the rank that holds the fewest bytes so far (the same deal on every rank, as
torch's ZeroRedundancyOptimizer does): an optimizer that looks at a whole tensor (a per-tensor
norm, as LAMB or Adafactor) then still sees whole tensors, which flat slices of the fusion
buckets would cut apart. Dealing over the whole model keeps the shards within 1% of 1/p on a
transformer. Within a bucket the owners' blocks are then of unequal length; the collectives
take blocks of any length in place (the core's ``reducescatter_in_place`` and
``allgather_in_place``), so nothing is padded or copied. Each ring step still lasts as long
as its longest block: a step's reduce-scatter took 1.35-1.41x that of equal slices (24 M
parameters, 2 ranks), and the longest blocks are 1.18-1.53x equal ones at 100 M on 2-4
ranks. ``zero_layout="flat"`` cuts each bucket into equal slices instead, stepped through
views of the parameters (elementwise optimizers only); whole steps measured within noise of
each other (``zero=2``: 0.70-1.03x of ``zero=0`` whole, 0.80-0.90x flat, in three runs),
so whole tensors, right for every optimizer, stay the default (docs/bigger-models.md).

Stage 1 averages every gradient as ``zero=0`` does (an allreduce of each bucket while backward
runs), so every rank still holds full gradients for hooks and inspection; stage 2 reduces
each bucket's gradients to their owners where autograd put them (a reduce-scatter of the
gradient tensors themselves, ordered by owner) and drops the gradients a rank does not own.
Then each rank steps its own parameters only, so optimizer state (momentum, Adam's moments)
exists for its shard alone, and the updated weights go back to every rank (an allgather of
each bucket, straight into the parameters). On the GPU (not yet run on one) the gradients go
through a reduce-scatter buffer padded to the longest block, and the weights through an
allgather buffer.

The step narrows each parameter group to the owned parameters for the length of the wrapped
optimizer's own ``step()``: the groups' hyperparameters are the ones users and LR schedulers
change, so nothing needs copying between a "local" optimizer and the wrapper.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from ..compression import Compression
from ..core import collectives as core
from ..core import runtime
from ..core.ops import ReduceOp
from ..sharding import partition
from .averaging import _Bucket, _Distributed
from .collectives import (
    TensorHandle,
    allgather_async,
    allreduce,
    as_numpy,
    reducescatter_async,
)
from .state import allgather_object

SHARD_KEY = "ringplug_shard"  # marks a dict from sharded_state_dict()
# Weight gathers through a buffer (device memory) in flight at once. Measured on CPU before
# the gather went in place (24 M parameters, 2 ranks, zero=1 alone): with 2 the peak resident
# memory was 973-1008 MB against zero=0's 931 MB, with 1 it was 927 MB, the step no slower.
_GATHERS_IN_FLIGHT = 1


def check_shardable(
    optimizer: torch.optim.Optimizer, zero: int, compression: Compression, layout: str = "whole"
) -> None:
    """Refuse what cannot be sharded, with what to use instead."""
    if zero not in (0, 1, 2):
        raise ValueError(f"zero must be 0, 1 or 2, got {zero!r}.")
    if layout not in ("whole", "flat"):
        raise ValueError(f"zero_layout must be 'whole' or 'flat', got {layout!r}.")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "LBFGS cannot be sharded: its step treats every parameter of the model as one "
            "vector (line search, curvature history). Use zero=0 with LBFGS, or an optimizer "
            "that updates each tensor on its own (SGD, Adam, AdamW, ...) with zero=1 or 2."
        )
    if zero == 2 and compression is not Compression.none:
        raise ValueError(
            "zero=2 sends gradients to their owners uncompressed; use zero=1 with "
            "compression, or compression=Compression.none."
        )


def _even_bounds(count: int, parts: int) -> list[int]:
    """`count` elements cut into `parts` slices as equal as can be (earlier ones longer)."""
    base, extra = divmod(count, parts)
    return [r * base + min(r, extra) for r in range(parts + 1)]


class _Sharded(_Distributed):
    """Mixed into the user's optimizer class for ``zero=1`` and ``zero=2``."""

    # -------------------------------------------------------------- setup
    def _ringplug_shard(self, stage: int, layout: str = "whole") -> None:
        self._ringplug_stage = stage
        rank, size = runtime.rank(), runtime.size()
        # A world of one has no buckets: every parameter is its own, whole.
        self._ringplug_layout = layout if size > 1 else "whole"
        self._ringplug_pieces: list[_Piece] = []
        params = [p for group in self.param_groups for p in group["params"]]
        trainable = [p for p in params if p.requires_grad]
        owners = partition([p.numel() * p.element_size() for p in trainable], size)
        self._ringplug_owner = {id(p): r for p, r in zip(trainable, owners, strict=True)}
        self._ringplug_mine = {id(p) for p in trainable if self._ringplug_owner[id(p)] == rank}
        # Positions in the flat list of parameters, as torch's state dicts number them.
        self._ringplug_owned_indices = {
            i for i, p in enumerate(params) if id(p) in self._ringplug_mine
        }
        for bucket in self._ringplug_buckets:
            # The bucket's parameters by owner: what each rank sends in the reduce-scatter
            # and gets back in the gather is then one contiguous segment.
            bucket.by_owner = sorted(bucket.params, key=lambda p: self._ringplug_owner[id(p)])
            bucket.counts = [0] * size  # elements per owner
            bucket.owned_tensors = [0] * size
            for p in bucket.params:
                bucket.counts[self._ringplug_owner[id(p)]] += p.numel()
                bucket.owned_tensors[self._ringplug_owner[id(p)]] += 1
        self._ringplug_consolidated: dict[str, Any] | None = None
        if self._ringplug_layout == "flat":
            self._ringplug_cut(params)
            return
        for p in list(self.state):  # state the optimizer had before wrapping, not ours
            if id(p) not in self._ringplug_mine:
                del self.state[p]

    def _ringplug_cut(self, params: list[torch.nn.Parameter]) -> None:
        """The flat layout: each bucket's elements, in its own order, cut into p equal
        slices; this rank steps slice `rank` of each, through pieces that are views of the
        parameters (an optimizer updating a piece updates the parameter)."""
        rank, size = runtime.rank(), runtime.size()
        index_of = {id(p): i for i, p in enumerate(params)}
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        self._ringplug_mine, self._ringplug_owned_indices = set(), set()
        for bucket in self._ringplug_buckets:
            if any(p.is_cuda or not p.is_contiguous() for p in bucket.params):
                raise ValueError(
                    "zero_layout='flat' needs contiguous parameters in host memory; use "
                    "zero_layout='whole' (the default)."
                )
            bucket.by_owner = bucket.params
            bounds = _even_bounds(sum(p.numel() for p in bucket.params), size)
            bucket.counts = [bounds[r + 1] - bounds[r] for r in range(size)]
            lo, hi, start = bounds[rank], bounds[rank + 1], 0
            for p in bucket.params:
                a, b = max(lo - start, 0), min(hi - start, p.numel())
                if a < b:
                    piece = _Piece(p, index_of[id(p)], group_of[id(p)], a, b)
                    self._ringplug_pieces.append(piece)
                    self._ringplug_owned_indices.add(piece.index)
                    if piece.whole:
                        self._ringplug_mine.add(id(p))
                start += p.numel()
        bucket_of = self._ringplug_bucket_of
        for piece in self._ringplug_pieces:
            bucket = bucket_of[id(piece.param)]
            bucket.pieces = [*getattr(bucket, "pieces", []), piece]
            if not piece.whole:
                bucket.partly = {*getattr(bucket, "partly", set()), id(piece.param)}
        self._ringplug_pieces.sort(key=lambda piece: piece.index)
        before = super(_Distributed, self).state_dict()["state"]
        self.state.clear()
        self._ringplug_load_pieces(before)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "A sharded DistributedOptimizer deals out its parameters when it is built; add the "
            "group to the optimizer before wrapping it."
        )

    # -------------------------------------------------------------- gradients
    def _ringplug_start(self, bucket: _Bucket) -> None:
        if self._ringplug_stage == 1:
            super()._ringplug_start(bucket)
            return
        if getattr(bucket, "reaped", False):  # reduced during backward already
            return
        for p in bucket.params:
            if p.grad is None:  # no gradient this step: reduced as zeros, like every rank's
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif p.grad.is_sparse:
                raise RuntimeError(
                    "zero=2 does not reduce sparse gradients; use zero=1 (or zero=0) for "
                    "models with sparse gradients (nn.Embedding(sparse=True))."
                )
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
        average = self._ringplug_op is ReduceOp.AVERAGE
        scales = {
            "prescale_factor": 1.0 / self._ringplug_predivide if average else 1.0,
            "postscale_factor": self._ringplug_predivide if average else 1.0,
        }
        name = f"{self._ringplug_prefix}.{bucket.index}"
        grads = [p.grad for p in bucket.by_owner]
        if grads[0].is_cuda:
            bucket.handle = self._ringplug_padded(bucket, grads, name, scales)
        else:
            # In place, where autograd put the gradients, each owner's block as long as
            # its parameters: no copy and no padding. The owned gradients end averaged; the
            # others are scratch, dropped here (the engine holds them until it is done).
            arrays = [as_numpy(g.reshape(-1)) for g in grads]
            handle = core.reducescatter_in_place_async(
                [array for array, _ in arrays],
                bucket.counts,
                self._ringplug_op,
                name=name,
                dtype=arrays[0][1],
                **scales,
            )
            bucket.handle = TensorHandle(handle, lambda _: None)
        partly = getattr(bucket, "partly", ())
        for p in bucket.params:
            if id(p) not in self._ringplug_mine and id(p) not in partly:
                p.grad = None  # stage 2: sent to its owner, not kept
        # Finish the buckets already reduced (on the GPU path, each padded buffer is then
        # freed as soon as its reduce-scatter is done, not all of them at the end).
        for earlier in self._ringplug_buckets:
            if earlier is not bucket and earlier.handle is not None and earlier.handle.done():
                self._ringplug_finish(earlier)
                earlier.reaped = True

    def _ringplug_padded(
        self, bucket: _Bucket, grads: list[torch.Tensor], name: str, scales: dict[str, float]
    ) -> TensorHandle:
        """The reduce-scatter of device memory: one row per owner, each as long as the
        longest segment, so that rank r gets row r; the owned gradients become views of it."""
        rows = grads[0].new_empty(runtime.size(), max(bucket.counts))
        offset = 0
        for owner, count in enumerate(bucket.counts):
            parts = grads[offset : offset + bucket.owned_tensors[owner]]
            offset += len(parts)
            if parts:
                torch.cat([g.reshape(-1) for g in parts], out=rows[owner, :count])
            rows[owner, count:].zero_()  # only the padding: the rest is written above

        def owned(block: torch.Tensor) -> None:
            mine, start = block.reshape(-1), 0
            for p in bucket.by_owner:
                if id(p) in self._ringplug_mine:
                    p.grad = mine[start : start + p.numel()].view_as(p)
                    start += p.numel()

        handle = reducescatter_async(rows, self._ringplug_op, name=name, **scales)
        return TensorHandle(handle, owned)

    def _ringplug_finish(self, bucket: _Bucket) -> int:
        if self._ringplug_stage == 1:
            nbytes = super()._ringplug_finish(bucket)
        elif getattr(bucket, "reaped", False):
            bucket.reaped = False
            return bucket.nbytes
        else:
            bucket.handle.wait()
            bucket.handle = None
            bucket.pending = len(bucket.params)
            nbytes = bucket.nbytes
        for piece in getattr(bucket, "pieces", ()):
            grad = piece.param.grad
            if grad.is_sparse:
                raise RuntimeError(
                    "zero_layout='flat' does not take sparse gradients; use "
                    "zero_layout='whole' (the default)."
                )
            piece.tensor.grad = grad.view(-1)[piece.start : piece.stop]
            if self._ringplug_stage == 2 and not piece.whole:
                # Its own slice only: the rest of the parameter's gradient is another's.
                piece.tensor.grad = piece.tensor.grad.clone()
                piece.param.grad = None
        return nbytes

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the averaged gradients so that their norm over every shard is at most
        `max_norm`, as ``torch.nn.utils.clip_grad_norm_`` over the whole model; returns that
        total norm. Averages the gradients first if `synchronize()` has not; one allreduce
        of one number. Call it on every rank, between backward and `step()`."""
        if not self._ringplug_synchronized and not self._ringplug_skip:
            self.synchronize()
        if self._ringplug_layout == "flat":
            owned = [piece.tensor.grad for piece in self._ringplug_pieces]
        else:
            owned = [
                p.grad
                for group in self.param_groups
                for p in group["params"]
                if id(p) in self._ringplug_mine and p.grad is not None
            ]
        norm_type = float(norm_type)
        local = torch.zeros((), dtype=torch.float32)
        if owned:
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type).float() for g in owned])
            local = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
        if runtime.size() > 1:
            op = "max" if math.isinf(norm_type) else "sum"
            local = allreduce(local.reshape(1), op, name=f"{self._ringplug_prefix}.norm")[0]
        total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self._ringplug_layout == "flat" and self._ringplug_stage == 2:
            kept = owned  # the pieces' gradients (views of the wholly owned ones' too)
        else:  # stage 1 keeps every gradient (the pieces' are views): keep them consistent
            kept = [p.grad for group in self.param_groups for p in group["params"]]
        for grad in kept:
            if grad is not None:
                grad.mul_(scale.to(grad.dtype))
        return total

    # -------------------------------------------------------------- step
    def _ringplug_local_step(self, closure: Any) -> Any:
        self._ringplug_consolidated = None  # stale from now on
        loss = None
        if closure is not None:
            # The closure (zero_grad, forward, backward: Lightning's, or a user's) runs with
            # every parameter group whole: run inside the narrowed step it would clear only
            # the owned gradients, and with zero=1 the others would add up step after step.
            # LBFGS, the one torch optimizer that calls it more than once, is refused.
            with torch.enable_grad():
                loss = closure()
        with self._ringplug_narrowed():
            super()._ringplug_local_step(None)
        self._ringplug_gather()
        return loss

    @contextlib.contextmanager
    def _ringplug_narrowed(self) -> Iterator[None]:
        """The parameter groups hold only what this rank steps (its parameters, or with the
        flat layout its pieces) for the length of the block."""
        everything = [group["params"] for group in self.param_groups]
        try:
            if self._ringplug_layout == "flat":
                for g, group in enumerate(self.param_groups):
                    group["params"] = [x.tensor for x in self._ringplug_pieces if x.group == g]
            else:
                for group in self.param_groups:
                    group["params"] = [p for p in group["params"] if id(p) in self._ringplug_mine]
            yield
        finally:
            for group, params in zip(self.param_groups, everything, strict=True):
                group["params"] = params

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for piece in self._ringplug_pieces:
            piece.tensor.grad = None  # a view keeps the parameter's whole gradient alive

    def _ringplug_gather(self) -> None:
        """Every owner's updated weights to every rank, a bucket at a time."""
        if self._ringplug_buckets and self._ringplug_gather_in_place():
            return
        pending: deque[tuple[_Bucket, TensorHandle]] = deque()
        for bucket in self._ringplug_buckets:
            mine = [p.detach().reshape(-1) for p in bucket.by_owner if id(p) in self._ringplug_mine]
            flat = torch.cat(mine) if mine else bucket.params[0].new_empty(0)
            name = f"{self._ringplug_prefix}.weights.{bucket.index}"
            pending.append((bucket, allgather_async(flat, name=name)))
            if len(pending) >= _GATHERS_IN_FLIGHT:
                self._ringplug_scatter(*pending.popleft())
        while pending:
            self._ringplug_scatter(*pending.popleft())

    def _ringplug_gather_in_place(self) -> bool:
        """The weights gathered straight into the parameters (host memory, each parameter
        contiguous): no staging copy, no buffer for the result, no copy out of it. False
        where that cannot be done, for the gather through a buffer."""
        params = [p for bucket in self._ringplug_buckets for p in bucket.params]
        if any(p.is_cuda or not p.is_contiguous() for p in params):
            return False
        handles = []
        for bucket in self._ringplug_buckets:
            arrays = [as_numpy(p.detach().reshape(-1)) for p in bucket.by_owner]
            handles.append(
                core.allgather_in_place_async(
                    [array for array, _ in arrays],
                    bucket.counts,
                    name=f"{self._ringplug_prefix}.weights.{bucket.index}",
                    dtype=arrays[0][1],
                )
            )
        for handle in handles:
            handle.wait()
        return True

    def _ringplug_scatter(self, bucket: _Bucket, handle: TensorHandle) -> None:
        gathered = handle.wait()
        offset = 0
        with torch.no_grad():
            for p in bucket.by_owner:
                if id(p) not in self._ringplug_mine:
                    p.copy_(gathered[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    # -------------------------------------------------------------- state dicts
    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, as torch numbers it (by position among
        all the parameters; with the flat layout, among this rank's pieces), marked with the
        rank, world size and layout it came from. Load it with `load_sharded_state_dict` on
        the same rank of a run with as many ranks and the same layout."""
        if self._ringplug_layout == "flat":
            with self._ringplug_narrowed():
                state = super(_Distributed, self).state_dict()
        else:
            state = super(_Distributed, self).state_dict()
        state[SHARD_KEY] = self._ringplug_origin()
        return state

    def _ringplug_origin(self) -> dict[str, Any]:
        origin: dict[str, Any] = {"rank": runtime.rank(), "size": runtime.size()}
        if self._ringplug_layout == "flat":
            origin["layout"] = "flat"
        return origin

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `sharded_state_dict` returned on this rank of a run of this size."""
        origin = state_dict.get(SHARD_KEY)
        if origin is None:
            raise ValueError(
                "Not a sharded state dict (no 'ringplug_shard'); load a consolidated or plain "
                "optimizer state dict with load_state_dict()."
            )
        here = self._ringplug_origin()
        if origin != here:
            layouts = (origin.get("layout", "whole"), here.get("layout", "whole"))
            raise ValueError(
                f"This shard was saved by rank {origin['rank']} of {origin['size']} "
                f"(zero_layout={layouts[0]!r}), but this is rank {here['rank']} of "
                f"{here['size']} (zero_layout={layouts[1]!r}). To resume on another number "
                "of ranks or layout, save with consolidate_state_dict() + state_dict() and "
                "load that."
            )
        state_dict = {k: v for k, v in state_dict.items() if k != SHARD_KEY}
        if self._ringplug_layout == "flat":  # saved over the groups of pieces
            with self._ringplug_narrowed():
                super(_Distributed, self).load_state_dict(state_dict)
        else:
            super(_Distributed, self).load_state_dict(state_dict)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect every rank's shard on rank `to`, whose `state_dict()` then returns the
        whole state, loadable by a plain optimizer of the same class. Call it on every rank
        (each shard travels to every rank once, as an object allgather; other ranks drop
        what they receive)."""
        flat = self._ringplug_layout == "flat"
        mine = self._ringplug_piece_states() if flat else super(_Distributed, self).state_dict()
        shards = allgather_object(mine, name=f"{self._ringplug_prefix}.consolidate")
        if runtime.rank() != to:
            self._ringplug_consolidated = None
            return
        if flat:
            self._ringplug_consolidated = self._ringplug_stitch(shards)
            return
        whole = dict(shards[to])
        whole["state"] = {}
        for shard in shards:
            whole["state"].update(shard["state"])
        whole["state"] = dict(sorted(whole["state"].items()))
        self._ringplug_consolidated = whole

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, on the rank that `consolidate_state_dict` named (since
        the last step); in a world of one, always. Other ranks: use `sharded_state_dict()`."""
        if runtime.size() == 1:
            return super(_Distributed, self).state_dict()
        if self._ringplug_consolidated is None:
            raise RuntimeError(
                "This optimizer's state is sharded over the ranks: call "
                "optimizer.consolidate_state_dict(to=RANK) on every rank first, then "
                "state_dict() on RANK; or save each rank's sharded_state_dict()."
            )
        return self._ringplug_consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole (consolidated or plain) optimizer state dict, saved on any number of
        ranks: each rank keeps its shard of it. A dict from `sharded_state_dict` goes to
        `load_sharded_state_dict`."""
        if SHARD_KEY in state_dict:
            self.load_sharded_state_dict(state_dict)
            return
        state_dict = dict(state_dict)
        whole_state = state_dict["state"]
        state_dict["state"] = {
            k: v for k, v in whole_state.items() if k in self._ringplug_owned_indices
        }
        if self._ringplug_layout == "flat":  # the hyperparameters, then each piece's slice
            super(_Distributed, self).load_state_dict({**state_dict, "state": {}})
            self._ringplug_load_pieces(state_dict["state"])
        else:
            super(_Distributed, self).load_state_dict(state_dict)
        self._ringplug_consolidated = None

    # -------------------------------------------------------------- flat layout's state
    def _ringplug_piece_states(self) -> list[tuple[int, int, int, dict[str, Any]]]:
        """(parameter index, start, stop, state) of each of this rank's pieces."""
        return [
            (x.index, x.start, x.stop, dict(self.state[x.tensor]))
            for x in self._ringplug_pieces
            if x.tensor in self.state
        ]

    def _ringplug_stitch(self, shards: list[Any]) -> dict[str, Any]:
        """The whole state dict, as a plain optimizer's, from every rank's pieces: each
        value shaped as its piece goes to its place in a tensor shaped as the parameter;
        any other (Adam's step count) is the same in every piece and is taken once."""
        params = [p for group in self.param_groups for p in group["params"]]
        state: dict[int, dict[str, Any]] = {}
        for index, start, stop, values in (entry for shard in shards for entry in shard):
            param, into = params[index], state.setdefault(index, {})
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.shape == (stop - start,):
                    if key not in into:
                        into[key] = value.new_zeros(param.shape)
                    into[key].view(-1)[start:stop] = value
                else:
                    into.setdefault(key, value)
        groups, first = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(first, first + len(group["params"])))
            first += len(group["params"])
            groups.append(packed)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _ringplug_load_pieces(self, whole_state: dict[Any, dict[str, Any]]) -> None:
        """Each piece's slice of a whole state (keyed by parameter index or parameter)."""
        for piece in self._ringplug_pieces:
            values = whole_state.get(piece.index, whole_state.get(piece.param))
            if values is None:
                continue
            self.state[piece.tensor] = {
                key: (
                    value.detach().reshape(-1)[piece.start : piece.stop].clone()
                    if isinstance(value, torch.Tensor) and value.shape == piece.param.shape
                    else value.clone()
                    if isinstance(value, torch.Tensor)
                    else value
                )
                for key, value in values.items()
            }


class _Piece:
    """A slice of one parameter that this rank steps (the flat layout): a leaf tensor over
    the parameter's own memory, which the optimizer updates in place."""

    def __init__(self, param: torch.nn.Parameter, index: int, group: int, start: int, stop: int):
        self.param, self.index, self.group = param, index, group
        self.start, self.stop = start, stop
        self.whole = start == 0 and stop == param.numel()
        self.tensor = torch.nn.Parameter(param.detach().view(-1)[start:stop])
