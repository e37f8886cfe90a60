"""What ``ringplug.horovod``'s torch, keras and tensorflow modules share: Horovod's basics
(init, ranks, capability queries, ops, timeline) on ringplug's core."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from .. import core
from ..core import runtime
from ..core.errors import RingplugError
from ..core.ops import ReduceOp, as_op

# Horovod's basics, the same in ringplug.horovod.torch, .keras and .tensorflow (each module
# adds its own ``elastic``).
__all__ = [
    "Adasum",
    "Average",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gpu_available",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]

# What a failed collective raises, under Horovod's name: ringplug's errors (mismatches, a
# peer's bad arguments, a rank that left) are RuntimeErrors, as Horovod's are.
HorovodInternalError = RingplugError

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


class _Adasum:
    """Horovod's Adasum op: the allreduces and DistributedOptimizer of the torch and
    TensorFlow modules take it (`resolve_op`, which the other reductions use, refuses it)."""

    def __repr__(self) -> str:
        return "Adasum"


Adasum = _Adasum()


class ProcessSet:
    """Horovod's process set: some of the world's ranks, for `process_set=` arguments.

    Made from a list of the world's ranks (kept sorted), then registered on every rank with
    `add_process_set` or `init(process_sets=[...])`, which give it its `process_set_id`.
    As in Horovod, root ranks of a set's broadcasts are world ranks; `rank()` is this
    rank's place in the set (0..size()-1), for reading the result of an allgather.

    Args:
        ranks_or_comm: the world's ranks in the set. (An mpi4py communicator, which Horovod
            also takes, is refused: pass ``comm`` translated to the world's ranks.)

    Example:
        ```python
        evens = hvd.add_process_set(range(0, hvd.size(), 2))  # every rank calls it
        if evens.included():
            total = hvd.allreduce(t, op=hvd.Sum, process_set=evens)
        hvd.remove_process_set(evens)  # every rank, once nothing is in flight on it
        ```
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None
    _core: Any = None  # ringplug.core's ProcessSet, once registered (None for the world)

    def __init__(self, ranks_or_comm: Any) -> None:
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError(
                f"ProcessSet takes a list of the world's ranks, not {ranks_or_comm!r} "
                "(ringplug does not make sets from MPI communicators)."
            ) from None
        if not all(isinstance(r, int) for r in ranks):
            raise ValueError(
                f"ProcessSet takes a list of the world's ranks (ints), not {ranks_or_comm!r}."
            )
        self.ranks = sorted(ranks)

    def size(self) -> int | None:
        """The number of ranks in the set; None while it is not registered."""
        if self.process_set_id is None:
            return None
        return core.size() if self.process_set_id == 0 else len(self.ranks or ())

    def rank(self) -> int | None:
        """This rank's place in the set; None while it is not registered. ValueError on a
        rank outside the set."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return core.rank()
        if not self.included():
            raise ValueError(f"Rank {core.rank()} is not part of {self}, so it has no rank in it.")
        return self._core.rank()

    def included(self) -> bool | None:
        """Whether this rank is in the set; None while it has no ranks."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return core.rank() in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._core = None

    def __repr__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
            f"mpi_comm={self.mpi_comm})"
        )


global_process_set = object.__new__(ProcessSet)  # all ranks; its ranks are set by init()
global_process_set.process_set_id = 0
_SET = global_process_set  # the default of every process_set
_registered: dict[int, ProcessSet] = {}  # this process's sets, by id (the world's not in it)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (a `ProcessSet` or a list of the world's ranks) and return it.

    Collective over the world: every rank calls it with the same ranks, in the same order
    of calls as its collectives. Unlike Horovod, no ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or
    ``init(process_sets="dynamic")`` is needed first.

    Raises:
        ValueError: a set of the same ranks is registered already (the world's included),
            or the ranks are duplicated or outside the world (on every rank).
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    # Made before the duplicate check, so that ranks that passed different sets get the
    # core's MismatchError together instead of some waiting for the others; the ranks
    # then agree on the set, and each finds the same duplicate in the same registry.
    made = core.add_process_set(process_set.ranks or ())
    if list(made.ranks) == list(range(core.size())) or any(
        list(made.ranks) == other.ranks for other in _registered.values()
    ):
        core.remove_process_set(made)
        raise ValueError(
            f"Attempted to add a duplicate process set: {process_set} has the ranks of a "
            "set that is registered already; use that one (or remove it first)."
        )
    process_set._core = made
    process_set.process_set_id = made.process_set_id
    _registered[made.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a registered process set; every rank calls it, once nothing is in flight on
    the set (else RingplugError on every rank). Returns False, as Horovod, for the global
    set or a set that is not registered."""
    if process_set.process_set_id in (None, 0) or process_set._core is None:
        return False
    core.remove_process_set(process_set._core)
    _registered.pop(process_set.process_set_id, None)
    process_set._invalidate()
    return True


def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Every registered set's id and world ranks, the world's (0) included: what Horovod's
    ``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()`` gives."""
    sets = {0: list(range(core.size()))}
    for set_id in sorted(_registered):
        sets[set_id] = list(_registered[set_id].ranks or [])
    return sets


def check_process_set(process_set: Any) -> None:
    """What remains for functions decorated with `on_process_set`: the world's set."""
    if process_set is not global_process_set and process_set is not None:
        raise NotImplementedError(
            f"process_set={process_set}: process sets other than hvd.global_process_set "
            "are not taken here; leave process_set at its default."
        )


class ProcessSetArgumentError(ValueError):
    """A `process_set=` this rank cannot run on: it is not a member, or the root rank is not
    in the set (the TensorFlow layer raises these as ``tf.errors.InvalidArgumentError``, as
    Horovod's ops do)."""


def _member_engine(process_set: Any, what: str) -> Any:
    """The core engine of a registered set this rank is in; ValueError otherwise."""
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"hvd.{what}: process_set must be a hvd.ProcessSet, not {process_set!r}.")
    if process_set.process_set_id is None or process_set._core is None:
        raise ValueError(
            f"hvd.{what}: {process_set} is not registered (or was removed); register it "
            "with hvd.add_process_set() or hvd.init(process_sets=[...]) on every rank."
        )
    if not process_set.included():
        raise ProcessSetArgumentError(
            f"hvd.{what}: Rank {core.rank()} is not a member of the provided process set "
            f"{process_set}; call its collectives on its members only "
            "(`if process_set.included(): ...`)."
        )
    return process_set._core._member_engine(what)


def _set_root(process_set: ProcessSet, root_rank: int, what: str) -> int:
    """A world root rank (Horovod's numbering) as the set's own (the core's)."""
    ranks = process_set.ranks or []
    if root_rank not in ranks:
        raise ProcessSetArgumentError(
            f"hvd.{what} received invalid root rank {root_rank} for provided process set "
            f"{process_set}: root ranks are world ranks of the set's members ({ranks})."
        )
    return ranks.index(root_rank)


def on_process_set(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (which takes `process_set`, and maybe `root_rank`) run on the set's core
    engine when `process_set` is not the world's, with its world root rank made the set's."""
    signature = inspect.signature(function)
    # Where `process_set` comes by position (None: by keyword only), so that the world's set
    # is found without binding the arguments (`Signature.bind` cost a small synchronous call
    # a fifth of its time).
    parameters = list(signature.parameters.values())
    index = [p.name for p in parameters].index("process_set")
    by_position = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters[: index + 1])
    position = index if by_position else None

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if position is not None and len(args) > position:
            process_set = args[position]
        else:
            process_set = kwargs.get("process_set", global_process_set)
        if process_set is global_process_set or process_set is None:
            return function(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        engine = _member_engine(process_set, function.__name__)
        bound.apply_defaults()
        bound.arguments["process_set"] = global_process_set
        if "root_rank" in bound.arguments:
            root = bound.arguments["root_rank"]
            bound.arguments["root_rank"] = _set_root(process_set, root, function.__name__)
        token = runtime.scope.set(engine)
        try:
            return function(*bound.args, **bound.kwargs)
        finally:
            runtime.scope.reset(token)

    return call


def resolve_op(average: bool | None, op: Any) -> ReduceOp:
    """Horovod's (average, op) pair -> one op; Average when neither is given."""
    if op is Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is taken by allreduce and grouped_allreduce (torch and "
            "TensorFlow), torch's DistributedOptimizer and TensorFlow's "
            "DistributedGradientTape only; use op=hvd.Sum or hvd.Average here."
        )
    if op is not None and average is not None:
        raise ValueError("give either op= or the deprecated average=, not both.")
    if op is None:
        return ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    return as_op(op)


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start ringplug (MPI) on all ranks, and register `process_sets` on every rank.

    Args:
        comm: not supported (ringplug runs over MPI's world); leave it None.
        process_sets: None (default), ``"dynamic"`` (the same: ringplug always lets
            `add_process_set` be called later), or a list of `ProcessSet` objects or
            lists of ranks, registered in order; hold on to the `ProcessSet` objects to
            pass them as ``process_set=``. When one is refused (on every rank), those
            registered before it are removed again, as Horovod registers none of them.
    """
    if comm is not None:
        raise NotImplementedError(
            "ringplug.horovod.init() runs over MPI's world; it takes no communicator."
        )
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f'process_sets={process_sets!r}: pass a list of sets or "dynamic".')
        process_sets = []
    core.init()
    global_process_set.ranks = list(range(core.size()))
    added: list[ProcessSet] = []
    for index, process_set in enumerate(process_sets or []):
        try:
            added.append(add_process_set(process_set))
        except (ValueError, RingplugError) as error:
            for made in reversed(added):  # every rank refused the same entry: all remove
                remove_process_set(made)
            if isinstance(error, ValueError):
                raise ValueError(f"init(process_sets=...) entry number {index}: {error}") from None
            raise


def shutdown() -> None:
    """Leave the job (every rank); the registered process sets are removed with it."""
    for process_set in list(_registered.values()):
        process_set._invalidate()
    _registered.clear()
    core.shutdown()


is_initialized = core.is_initialized
size = core.size
rank = core.rank
local_size = core.local_size
local_rank = core.local_rank
cross_size = core.cross_size
cross_rank = core.cross_rank


def _yes() -> bool:
    return True


def _no() -> bool:
    return False


# What this build has: MPI (at THREAD_MULTIPLE); no Gloo, ROCm, oneCCL or IBM DDL.
mpi_built = mpi_enabled = mpi_threads_supported = _yes
gloo_built = gloo_enabled = rocm_built = ccl_built = ddl_built = _no


def nccl_built() -> int:
    """NCCL's version code (e.g. 23203) when ringplug finds an NCCL library, else 0."""
    from ..core.gpu import nccl

    try:
        return nccl.version().code
    except nccl.NcclError:
        return 0


def cuda_built() -> bool:
    """Whether CUDA tensors can be reduced here (an NCCL library is found)."""
    return nccl_built() > 0


def gpu_available(ext_base_name: str = "", verbose: bool = False) -> bool:
    """Whether GPU tensors can be reduced here (Horovod's: its extension for
    `ext_base_name` was built with GPU support); ringplug's answer is `cuda_built()`."""
    return cuda_built()


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return core.size() == core.local_size() * core.cross_size()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write a Chrome trace of the engine to `file_path` (rank 0)."""
    core.start_timeline(file_path)


stop_timeline = core.stop_timeline


@on_process_set
def barrier(process_set: Any = _SET) -> None:
    """Wait until every rank of `process_set` (all of them by default) has called barrier
    (torch's and TensorFlow's, not Keras's)."""
    core.barrier()


# ---------------------------------------------------------------------------- Keras and TF
# What ringplug.horovod.keras and ringplug.horovod.tensorflow share beyond the basics (the
# names are each module's own, not in __all__: torch's take other arguments).
@on_process_set
def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: Any = _SET,
) -> Any:
    """Root's picklable `obj` on every rank of `process_set` (`root_rank` a world rank;
    `session`: Horovod's TF1 argument, unused)."""
    return core.broadcast_object(obj, root_rank, name=name)


@on_process_set
def allgather_object(
    obj: Any, session: Any = None, name: str | None = None, process_set: Any = _SET
) -> list[Any]:
    """Every rank's picklable `obj` (of `process_set`'s ranks), as a list in rank order
    (`session`: unused)."""
    return core.allgather_object(obj, name=name)


def local_layers_variables(local_layers: Any) -> list[Any]:
    """The trainable variables of Horovod's `local_layers` (None, a layer, or a list)."""
    if local_layers is None:
        return []
    layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
    return [variable for layer in layers for variable in layer.trainable_weights]
