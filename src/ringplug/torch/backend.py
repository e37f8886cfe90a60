"""The ``ringplug`` backend of torch.distributed: every torch collective through ringplug's engine.

``import ringplug.torch`` registers it. Under ``ringrun`` (or any MPI launcher) a plain torch
program then needs no ``MASTER_ADDR``, port or store::

    import torch.distributed as dist
    import ringplug.torch  # registers the backend

    dist.init_process_group("ringplug")
    model = torch.nn.parallel.DistributedDataParallel(model)

Each call becomes one request of ringplug's engine (or, for the calls the core has no kind
for, a short sequence of them), so it gets what every ringplug collective gets: the ranks
agree on what they run before running it, a call that differs between ranks fails on every
rank with `MismatchError` naming what each rank passed, the stall inspector and
``RINGPLUG_TIMEOUT`` watch it, and the timeline shows it. CPU tensors take the MPI ring,
CUDA tensors NCCL. Requests are named ``torch.<group>#<n>`` (the n-th call on that group),
so the calls of one group are matched in the order each rank makes them, as torch requires.

Groups: ``dist.new_group()`` over every rank, whatever backend it names (Lightning asks for
``"gloo"`` around ``prepare_data``), is served by the engine as the default group is; a group
over some of the ranks (``new_group(ranks=[...])``, ``new_subgroups``, a ``DeviceMesh``'s
dimensions) runs on a process set of the core (`ringplug.add_process_set`): an engine of its
own over its members, with everything above, CPU and CUDA tensors alike; ranks outside it
get ``GroupMember.NON_GROUP_MEMBER``, and ``destroy_process_group(group)`` removes the set
among its members. ``new_group(..., use_local_synchronization=True)``, which torch calls on
the members only, makes the set among them (``add_process_set(members_only=True)``).
``monitored_barrier`` works on every group: a rank that does not arrive within the timeout
is named (`BarrierTimeoutError`). The store
(``dist.distributed_c10d._get_default_store()``, and every group's) is a TCPStore that rank
0 serves: ``set``/``get``/``wait``/``add`` reach every rank, and wait at most
``RINGPLUG_TIMEOUT``.

What the core cannot do raises on the calling rank with the call's name: point-to-point
``send``/``recv``, the bitwise ops ``BAND``/``BOR``/``BXOR`` and ``PREMUL_SUM``. torch's
per-call ``timeout`` is not used (but ``monitored_barrier``'s): ``RINGPLUG_TIMEOUT`` bounds
every wait.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import functools
import importlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..core import collectives as core
from ..core import runtime
from ..core.kinds.base import waited_at_once
from ..core.ops import ReduceOp
from ..core.process_sets import ProcessSet, add_process_set, remove_process_set
from . import collectives as rt
from .device import use_local_gpu

BACKEND = "ringplug"

_TYPES = dist.ReduceOp.RedOpType
_OPS = {
    _TYPES.SUM: ReduceOp.SUM,
    _TYPES.AVG: ReduceOp.AVERAGE,
    _TYPES.PRODUCT: ReduceOp.PRODUCT,
    _TYPES.MIN: ReduceOp.MIN,
    _TYPES.MAX: ReduceOp.MAX,
}

# Futures are completed on a thread of their own: their callbacks (DDP communication hooks,
# user code) may be slow or start other collectives, which must not happen on the engine's.
_completions: concurrent.futures.ThreadPoolExecutor | None = None
_completions_lock = threading.Lock()


def _completion_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _completions
    with _completions_lock:
        if _completions is None:
            _completions = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="ringplug-torch-futures"
            )
        return _completions


class RingWork(dist._Work):
    """A torch.distributed collective running in ringplug's engine.

    ``wait()`` blocks until it has finished and the outputs are written (it raises the
    collective's error, the same on every rank); ``is_completed()`` never blocks;
    ``get_future()`` gives a `torch.futures.Future` whose value is the list of output
    tensors, completed without anyone calling ``wait()`` (DDP's reducer relies on that).
    """

    def __init__(
        self,
        parts: Sequence[rt.TensorHandle],
        outputs: list[torch.Tensor],
        finish: Callable[[list[Any]], None] | None = None,
    ) -> None:
        super().__init__()
        self._parts = list(parts)
        self._outputs = outputs
        self._finish_outputs = finish
        self._lock = threading.Lock()
        self._finished = False
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None

    def _handles(self) -> list[Any]:
        return [part._handle for part in self._parts]

    def _settle(self) -> None:
        """Write the outputs once, on whichever thread gets here first after the engine."""
        with self._lock:
            if self._finished:
                return
            try:
                results = [part.wait() for part in self._parts]
                if self._finish_outputs is not None:
                    self._finish_outputs(results)
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter
                self._error = exc
            self._finished = True

    def is_completed(self) -> bool:
        if not self._finished and all(handle.done() for handle in self._handles()):
            self._settle()
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Any:
        return self._error if self.is_completed() else None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._settle()
        if self._error is not None:
            raise self._error
        return True

    synchronize = wait

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is not None:
                return self._future
            devices = sorted({str(t.device) for t in self._outputs if t.is_cuda})
            self._future = torch.futures.Future(devices=devices or None)
        handles = self._handles()
        remaining = [len(handles)]
        counter = threading.Lock()

        def one_done(_: Any) -> None:
            with counter:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                _completion_thread().submit(self._complete_future)

        if not handles:
            self._complete_future()
        for handle in handles:
            handle.add_done_callback(one_done)
        return self._future

    def _complete_future(self) -> None:
        self._settle()
        future = self._future
        assert future is not None
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._outputs)


def _submitting(opts: Any) -> contextlib.AbstractContextManager[None]:
    """What a call submits in: torch waits for a synchronous call (``asyncOp`` False) at
    once, so its cycle runs on the calling thread and the engine thread is not woken."""
    return waited_at_once() if getattr(opts, "asyncOp", True) is False else contextlib.nullcontext()


def _on_its_ranks(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (a collective of the group) submitted to the group's engine: the world's,
    or for a group over some of the ranks its process set's (`runtime.scope`, which the
    request builders read). Ranks are the group's own, as torch passes them (root ranks
    count in the group, as in the set)."""

    @functools.wraps(method)
    def call(self: RingProcessGroup, *args: Any, **kwargs: Any) -> Any:
        if self._process_set is None:
            return method(self, *args, **kwargs)
        engine = self._process_set._member_engine(f"torch.distributed {method.__name__}")
        token = runtime.scope.set(engine)
        try:
            return method(self, *args, **kwargs)
        finally:
            runtime.scope.reset(token)

    return call


class RingProcessGroup(dist.ProcessGroup):
    """torch.distributed's process group over ringplug's ranks: every rank of the job (on
    the world's engine), or some of them (on a process set's engine, `new_group`).

    Args:
        rank, size: this rank in the group and the group's size.
        tag: names the group's requests (``torch.<tag>#<n>``), the same on every rank.
        store: the group's store; libraries meet through it.
        timeout: the group's timeout; ``monitored_barrier()`` without one of its own waits
            that long (at most ``RINGPLUG_BARRIER_TIMEOUT``).
        process_set: the core's set of the group's ranks, or None for every rank.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        tag: str = "default",
        store: dist.Store | None = None,
        timeout: datetime.timedelta | None = None,
        process_set: ProcessSet | None = None,
    ) -> None:
        super().__init__(rank, size)
        self._tag = tag
        self._calls = itertools.count(1)
        self._store = store
        self._timeout = timeout or dist.default_pg_timeout
        self._group_name = ""
        self._process_set = process_set

    @property
    def process_set(self) -> ProcessSet | None:
        """The core's process set this group runs on (None: every rank, the world's)."""
        return self._process_set

    def name(self) -> str:
        return BACKEND

    # torch keeps a group's name in its backends, and this group has none of them.
    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    # ------------------------------------------------------------------ helpers
    def _name(self) -> str:
        # Numbered names are matched in call order and never cached (engine.cacheable_name).
        return f"torch.{self._tag}#{next(self._calls)}"

    def _refuse(self, call: str, why: str) -> RingWork:
        raise NotImplementedError(f"torch.distributed.{call} on the ringplug backend: {why}")

    def _op(self, call: str, opts: Any, name: str) -> ReduceOp:
        kind = opts.reduceOp.op
        op = _OPS.get(kind)
        if op is None:
            supported = "SUM, AVG, PRODUCT, MIN, MAX"
            core.reject(
                NotImplementedError(
                    f"torch.distributed.{call} on the ringplug backend: ReduceOp "
                    f"{kind.name} is not supported (ringplug reduces with "
                    f"{supported})."
                ),
                name,
            )
        return op

    # ------------------------------------------------------------------ reductions
    @_on_its_ranks
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RingWork:
        opts = opts or dist.AllreduceOptions()
        return self._allreduce("all_reduce", tensors, opts)

    @_on_its_ranks
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> RingWork:
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._allreduce("all_reduce_coalesced", tensors, opts)

    def _allreduce(self, call: str, tensors: list[torch.Tensor], opts: Any) -> RingWork:
        name = self._name()
        op = self._op(call, opts, name)
        parts = []
        # One request per dtype and device: the engine reduces each as one fused pass.
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in tensors:
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        with _submitting(opts):
            for index, group in enumerate(groups.values()):
                part_name = name if index == 0 else f"{name}.{index}"
                if len(group) == 1:  # dist.all_reduce: one tensor, the lighter request
                    parts.append(rt.allreduce_async_(group[0], op, name=part_name))
                else:
                    parts.append(rt.grouped_allreduce_async_(group, op, name=part_name))
        return RingWork(parts, list(tensors))

    @_on_its_ranks
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RingWork:
        opts = opts or dist.ReduceOptions()
        name = self._name()
        op = self._op("reduce", opts, name)
        tensor = tensors[opts.rootTensor]
        # The core has no rooted reduction: every rank gets the result, the root keeps it.
        handle = rt.allreduce_async(tensor, op, name=name)

        def finish(results: list[Any]) -> None:
            if self.rank() == opts.rootRank:
                with torch.no_grad():
                    tensor.copy_(results[0])

        return RingWork([handle], [tensor], finish)

    @_on_its_ranks
    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> RingWork:
        opts = opts or dist.ReduceScatterOptions()
        name = self._name()
        op = self._op("reduce_scatter", opts, name)
        output, pieces = outputs[0], inputs[0]
        _check_count("reduce_scatter", pieces, self.size(), name)
        stacked = torch.stack([piece.reshape(-1) for piece in pieces])
        return self._reduce_scatter_into(output, stacked, op, name)

    @_on_its_ranks
    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> RingWork:
        opts = opts or dist.ReduceScatterOptions()
        name = self._name()
        op = self._op("reduce_scatter_tensor", opts, name)
        if input.numel() != output.numel() * self.size():
            core.reject(
                ValueError(
                    f"torch.distributed.reduce_scatter_tensor: the input has {input.numel()} "
                    f"elements, but {self.size()} ranks x the output's {output.numel()} are needed."
                ),
                name,
            )
        return self._reduce_scatter_into(output, input.reshape(self.size(), -1), op, name)

    def _reduce_scatter_into(
        self, output: torch.Tensor, rows: torch.Tensor, op: ReduceOp, name: str
    ) -> RingWork:
        handle = rt.reducescatter_async(rows, op, name=name)
        return RingWork([handle], [output], lambda results: _copy(output, results[0]))

    # ------------------------------------------------------------------ broadcast
    @_on_its_ranks
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> RingWork:
        opts = opts or dist.BroadcastOptions()
        name = self._name()
        with _submitting(opts):
            parts = [rt.broadcast_async_(tensors[0], opts.rootRank, name=name)]
            for index, tensor in enumerate(tensors[1:], 1):
                parts.append(rt.broadcast_async_(tensor, opts.rootRank, name=f"{name}.{index}"))
        return RingWork(parts, list(tensors))

    # ------------------------------------------------------------------ gathers
    @_on_its_ranks
    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingWork:
        name = self._name()
        slots = outputs[0]
        _check_count("all_gather", slots, self.size(), name)
        return self._gather_into(slots, inputs[0], name)

    @_on_its_ranks
    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> RingWork:
        name = self._name()
        if output.numel() != input.numel() * self.size():
            core.reject(
                ValueError(
                    f"torch.distributed.all_gather_into_tensor: the output has {output.numel()} "
                    f"elements, but {self.size()} ranks x the input's {input.numel()} are needed."
                ),
                name,
            )
        handle = rt.allgather_async(input.reshape(-1), name=name)
        return RingWork([handle], [output], lambda results: _copy(output, results[0]))

    @_on_its_ranks
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingWork:
        works = [self._allgather_base(out, inp) for out, inp in zip(outputs, inputs, strict=True)]
        return _combined(works, list(outputs))

    @_on_its_ranks
    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingWork:
        works = [self.allgather([out], [inp]) for out, inp in zip(outputs, inputs, strict=True)]
        return _combined(works, [t for o in outputs for t in o])

    def _gather_into(self, slots: list[torch.Tensor], tensor: torch.Tensor, name: str) -> RingWork:
        # Flattened, so ranks may send different numbers of elements (as NCCL allows).
        handle = rt.allgather_async(tensor.reshape(-1), name=name)

        def finish(results: list[Any]) -> None:
            gathered = results[0]
            sizes = [slot.numel() for slot in slots]
            if sum(sizes) != gathered.numel():
                raise ValueError(
                    f"torch.distributed.all_gather: the ranks sent {gathered.numel()} elements "
                    f"in all, but this rank's output tensors hold {sum(sizes)}; give every "
                    "rank output tensors of the sizes the ranks send."
                )
            for slot, piece in zip(slots, gathered.split(sizes), strict=True):
                _copy(slot, piece)

        return RingWork([handle], list(slots), finish)

    @_on_its_ranks
    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingWork:
        opts = opts or dist.GatherOptions()
        name = self._name()
        if self.rank() == opts.rootRank:
            _check_count("gather", outputs[0], self.size(), name)
            return self._gather_into(outputs[0], inputs[0], name)
        # The core gathers to every rank; only the root keeps the result.
        handle = rt.allgather_async(inputs[0].reshape(-1), name=name)
        return RingWork([handle], [])

    @_on_its_ranks
    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> RingWork:
        opts = opts or dist.ScatterOptions()
        name = self._name()
        output = outputs[0]
        if self.rank() == opts.rootRank:
            pieces = inputs[0]
            _check_count("scatter", pieces, self.size(), name)
            rows = torch.stack([piece.reshape(-1) for piece in pieces])
            splits = [1] * self.size()
        else:
            rows = output.new_empty((0, output.numel()))
            splits = [0] * self.size()
        handle = rt.alltoall_async(rows, splits, name=name)
        return RingWork([handle], [output], lambda results: _copy(output, results[0][0]))

    @_on_its_ranks
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> RingWork:
        name = self._name()
        splits = list(input_split_sizes) or None
        handle = rt.alltoall_async(input, splits, name=name)

        def finish(results: list[Any]) -> None:
            received, counts = results[0]
            expected = list(output_split_sizes)
            if expected and counts.tolist() != expected:
                raise ValueError(
                    f"torch.distributed.all_to_all_single: rank {self.rank()} expected "
                    f"{expected} rows from the ranks but received {counts.tolist()}."
                )
            _copy(output, received)

        return RingWork([handle], [output], finish)

    @_on_its_ranks
    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingWork:
        name = self._name()
        _check_count("all_to_all", inputs, self.size(), name)
        _check_count("all_to_all", outputs, self.size(), name)
        if len({t.dtype for t in inputs}) > 1:
            core.reject(
                TypeError(
                    "torch.distributed.all_to_all on the ringplug backend needs "
                    "input tensors of one dtype."
                ),
                name,
            )
        flat = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0)
        handle = rt.alltoall_async(flat, [t.numel() for t in inputs], name=name)

        def finish(results: list[Any]) -> None:
            received, _ = results[0]
            sizes = [t.numel() for t in outputs]
            if sum(sizes) != received.numel():
                raise ValueError(
                    f"torch.distributed.all_to_all: rank {self.rank()} received "
                    f"{received.numel()} elements but its output tensors hold {sum(sizes)}."
                )
            for slot, piece in zip(outputs, received.split(sizes), strict=True):
                _copy(slot, piece)

        return RingWork([handle], list(outputs), finish)

    @_on_its_ranks
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingWork:
        works = [
            self._reduce_scatter_base(out, inp, opts)
            for out, inp in zip(outputs, inputs, strict=True)
        ]
        return _combined(works, list(outputs))

    # torch 2.13's Python API calls these names; C++ callers use the older ones.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # ------------------------------------------------------------------ barriers
    @_on_its_ranks
    def barrier(self, opts: Any = None) -> RingWork:
        handle = core.barrier_async(self._name())
        return RingWork([rt.TensorHandle(handle, lambda _: None)], [])

    @_on_its_ranks
    def monitored_barrier(
        self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """torch's ``monitored_barrier``: wait until every rank has called it, at most
        `timeout` (the group's when None, and never more than ``RINGPLUG_BARRIER_TIMEOUT``);
        then raise `BarrierTimeoutError` naming every rank that did not arrive (so
        `wait_all_ranks` is always honoured). Other collectives in flight go on."""
        limit = (timeout or self._timeout).total_seconds()
        seconds = min(limit, runtime.settings().barrier_timeout)
        with waited_at_once():
            handle = core.barrier_async(self._name(), timeout=seconds)
        handle.wait()

    # ------------------------------------------------------------------ groups
    def new_group(
        self,
        ranks: Sequence[int] | None,
        timeout: datetime.timedelta | None = None,
        pg_options: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
        backend: Any = None,
        **_: Any,
    ) -> dist.ProcessGroup | None:
        """torch's ``new_group`` while this is the default group (torch 2.13 and later hand
        every ``new_group`` call to it, whatever backend the call names: ``new_subgroups``
        and a ``DeviceMesh``'s dimensions come here too; each rank of the job calls it).

        A group of every rank is served by the world's engine, as this one. A group over
        some of the ranks is a process set of the core (`ringplug.add_process_set`, which
        every rank makes together: its ranks are compared first, so ranks that pass
        different groups fail alike with `MismatchError`); it runs on the set's engine,
        and ranks outside it get None (torch's ``GroupMember.NON_GROUP_MEMBER``).

        With ``use_local_synchronization=True`` torch calls here on the group's members
        only (it does not pass the flag: it names the group by a hash of its ranks
        instead, `_members_only`), and the group is a process set its members make among
        themselves (``add_process_set(ranks, members_only=True)``), even over every rank.
        """
        members = list(range(self.size())) if ranks is None else [int(r) for r in ranks]
        name = str(group_name or f"group{next(_groups)}")
        if self._process_set is not None:
            raise NotImplementedError(
                "new_group on a ringplug group over some of the ranks: torch makes groups "
                "on the default group (dist.new_group), which every rank calls."
            )
        members_only = _members_only(members, name)
        if members == list(range(self.size())) and not members_only:
            group = RingProcessGroup(self.rank(), self.size(), f"g{name}", self._store, timeout)
        else:
            if members != sorted(members):
                raise ValueError(
                    f"dist.new_group(ranks={members}, sort_ranks=False) on the ringplug "
                    "backend: a group's ranks are in the order of the job's ranks (a process "
                    "set's). Pass sort_ranks=True (the default), or the ranks in increasing "
                    "order."
                )
            process_set = add_process_set(members, members_only=members_only)
            if not process_set.included():
                remove_process_set(process_set, members_only=True)  # forgotten here at once
                return None
            # The requests' names need only agree among the members: torch's name for a
            # members-only group may not (its hash counts the groups each rank has).
            tag = str(process_set.process_set_id).replace("#", ".") if members_only else name
            group = RingProcessGroup(
                process_set.rank(),
                process_set.size(),
                f"g{tag}",
                self._store,
                timeout,
                process_set=process_set,
            )
        group._set_group_name(name)
        group._set_group_desc(group_desc or "undefined")
        return group

    def shutdown(self) -> None:
        """torch's ``destroy_process_group(group)`` (members only) and the job's end: a
        group over some of the ranks removes its process set, its members agreeing; refused
        on each of them (`RingplugError` naming ranks and calls) while any member has a
        collective of the group in flight."""
        process_set = self._process_set
        if process_set is not None and not process_set._removed:
            remove_process_set(process_set, members_only=True)

    def split_group(self, ranks: Sequence[int], *args: Any, **kwargs: Any) -> None:
        """torch's ``split_group``: refused, saying what to use instead. torch 2.13 itself
        refuses ``dist.split_group`` before asking any backend unless an accelerator is
        available (or torchcomms is on), so on CPU this is never reached."""
        raise NotImplementedError(
            "dist.split_group on the ringplug backend: ringplug makes groups with "
            "dist.new_group (or new_subgroups, new_subgroups_by_enumeration), which every rank "
            "calls, or which only the members call with use_local_synchronization=True; use "
            "one of them."
        )

    # ------------------------------------------------------------------ the rest
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> RingWork:
        return self._refuse("send", _NO_P2P)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> RingWork:
        return self._refuse("recv", _NO_P2P)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> RingWork:
        return self._refuse("recv", _NO_P2P)


_NO_P2P = (
    "point-to-point messages are not supported (ringplug runs collectives that every rank "
    "of the group takes part in). Use a collective (broadcast, all_to_all_single), on a "
    "group of the two ranks if only they exchange (dist.new_group(ranks=[a, b]))."
)


def _members_only(members: list[int], name: str) -> bool:
    """Whether torch asks for a group with ``use_local_synchronization=True``, calling on its
    members only: it does not pass the flag to ``new_group``, but names such a group by a
    hash of its ranks (``_hash_ranks_to_str``, just computed, so equal here), where other
    groups get a number."""
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    try:
        return bool(name == c10d._hash_ranks_to_str(members))
    except (AttributeError, TypeError):  # a torch without it names groups otherwise
        return False


def gloo_group(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta | None
) -> dist.ProcessGroup:
    """A torch process group of `size` ranks on gloo that meet through `store`, as torch
    builds one, for CPU and CUDA tensors (gloo stages CUDA tensors through the host). Its
    deadline is its timeout, at most ``RINGPLUG_TIMEOUT``: gloo then raises on the
    ranks that waited."""
    limit = runtime.settings().timeout
    seconds = min((timeout or dist.default_pg_timeout).total_seconds(), limit)
    deadline = datetime.timedelta(seconds=seconds)
    gloo = dist.ProcessGroupGloo(store, rank, size, deadline)
    gloo._set_sequence_number_for_group()
    try:
        group = dist.ProcessGroup(store, rank, size)
    except TypeError:  # torch 2.4's has no such constructor, and wraps a backend itself
        return gloo  # type: ignore[return-value]
    gloo_type = dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(gloo_type)
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), gloo_type, gloo)
    return group


def monitored_barrier(
    group: Any = None, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """torch.distributed's ``monitored_barrier``, which torch allows on gloo groups only,
    on ringplug's groups too (over every rank or a process set, and the gloo subgroups of a
    torch older than 2.13); anything else goes to torch's own."""
    from torch.distributed import distributed_c10d as c10d

    if group is c10d.GroupMember.NON_GROUP_MEMBER or not dist.is_initialized():
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)
    pg = c10d._get_default_group() if group in (None, dist.group.WORLD) else group
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if isinstance(pg, RingProcessGroup):
        return pg.monitored_barrier(timeout, wait_all_ranks)
    if dist.get_backend(pg) == BACKEND:  # a gloo subgroup of ringplug's (`new_group`)
        return pg.monitored_barrier(timeout or dist.default_pg_timeout, wait_all_ranks)
    return _torch_monitored_barrier(group, timeout, wait_all_ranks)


def _combined(works: list[RingWork], outputs: list[torch.Tensor]) -> RingWork:
    """One work for several calls started together (the coalesced forms)."""
    return RingWork(
        [part for work in works for part in work._parts],
        outputs,
        lambda _: [work.wait() for work in works],
    )


def _check_count(call: str, tensors: Sequence[torch.Tensor], size: int, name: str) -> None:
    if len(tensors) != size:
        core.reject(
            ValueError(
                f"torch.distributed.{call}: {len(tensors)} tensors given, but the group has "
                f"{size} ranks; pass one tensor per rank."
            ),
            name,
        )


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(source.reshape(target.shape))


# ---------------------------------------------------------------------- registration
def _create(store: Any, rank: int, size: int, timeout: Any) -> dist.ProcessGroup:
    """torch's constructor hook: a group over every rank of ringplug's world (and, unless
    CUDA is already in use, cuda:LOCAL_RANK as torch's current device: `device.py`); a
    torch older than 2.13, which does not hand ``new_group`` to the default group
    (`RingProcessGroup.new_group`), asks here for its groups over some of the ranks too, on
    their members only, which then run on gloo (a process set needs every rank)."""
    runtime.init()
    world, me = runtime.size(), runtime.rank()
    if size < world and dist.is_initialized():
        return gloo_group(store, rank, size, timeout)
    if world == 1 and size > 1:
        raise RuntimeError(
            f"torch.distributed asked the ringplug backend for {size} ranks, but this process "
            "is not part of an MPI job (ringplug's world is this one process). The ringplug "
            f"backend takes its ranks from MPI: start the program with `ringrun -np {size} "
            "python ...` (or mpiexec/srun), one process per rank: not with torchrun, and "
            "without the program starting its own ranks (mp.spawn, "
            "--multiprocessing-distributed); init_method='env://' reads the rank and world "
            "size ringrun sets (docs/torch.md, 'Programs that start their own processes')."
        )
    if size != world:
        raise ValueError(
            f"init_process_group asked the ringplug backend for a world of {size} ranks, but "
            f"the job has {world}. Leave world_size out of init_process_group under ringrun "
            "(ringplug takes it from MPI), or start as many ranks as it names."
        )
    if rank != me:
        raise ValueError(
            f"torch.distributed gave this process rank {rank}, but the MPI launcher made it "
            f"rank {me}. Leave rank and world_size out of init_process_group under ringrun "
            "(ringplug takes them from MPI), or make them agree."
        )
    use_local_gpu()
    return RingProcessGroup(rank, size, _group_tag(), store, timeout)


_groups = itertools.count()


def _group_tag() -> str:
    index = next(_groups)
    return "default" if index == 0 else f"group{index}"


def _mpi_env_rendezvous(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """torch's ``env://`` rendezvous, which under an MPI launcher with no ``MASTER_ADDR``
    takes rank and world size from MPI and starts the store over it (torch's own would stop
    with "environment variable MASTER_ADDR expected")."""

    def handler(
        url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs: Any
    ) -> Iterator[Any]:
        if os.environ.get("MASTER_ADDR") or runtime.launcher_world_size() is None:
            yield from original(url, timeout=timeout, **kwargs)
            return
        from .process_group import mpi_store

        yield mpi_store(timeout)
        raise RuntimeError("the ringplug rendezvous cannot be repeated")

    handler._ringplug = True  # type: ignore[attr-defined]
    return handler


_torch_monitored_barrier: Callable[..., Any] = dist.monitored_barrier


def register() -> None:
    """Make ``init_process_group("ringplug")`` available, and ``monitored_barrier`` on its
    groups (idempotent)."""
    global _torch_monitored_barrier
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    # The module, not torch.distributed.rendezvous (a function of the same name).
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if not getattr(handlers.get("env"), "_ringplug", False):
        handlers["env"] = _mpi_env_rendezvous(handlers["env"])
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    if c10d.monitored_barrier is not monitored_barrier:
        # torch refuses monitored_barrier on any group not named gloo; code reaches it as
        # torch.distributed.monitored_barrier (both names are the same function).
        _torch_monitored_barrier = c10d.monitored_barrier
        c10d.monitored_barrier = dist.monitored_barrier = monitored_barrier


def init_process_group() -> bool:
    """Start torch.distributed's default group on the ringplug backend, unless one exists.

    Returns whether this call created it (and so should destroy it).
    """
    if dist.is_initialized():
        return False
    from .process_group import job_store

    runtime.init()
    store = job_store(datetime.timedelta(seconds=runtime.settings().timeout))
    dist.init_process_group(BACKEND, store=store, rank=runtime.rank(), world_size=runtime.size())
    return True
