"""What ``ringplug.horovod``'s torch, keras and tensorflow modules share: Horovod's basics
(init, ranks, capability queries, ops, timeline) on ringplug's core."""

from __future__ import annotations

from typing import Any

from .. import core
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

_NO_PROCESS_SETS = (
    "ringplug has no process sets: every collective runs over all ranks. Leave "
    "process_set at its default (hvd.global_process_set)."
)


class ProcessSet:
    """Horovod's process sets: ringplug has one, `global_process_set` (all ranks), and
    refuses to make others."""

    process_set_id = 0

    def __init__(self, ranks: Any = None) -> None:
        raise NotImplementedError(_NO_PROCESS_SETS)

    def size(self) -> int:
        return core.size()

    def rank(self) -> int:
        return core.rank()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = object.__new__(ProcessSet)  # the one there is, not made by __init__
_SET = global_process_set  # the default of every process_set


def add_process_set(process_set: Any) -> None:
    """Refused: ringplug has no process sets."""
    raise NotImplementedError(_NO_PROCESS_SETS)


remove_process_set = add_process_set


def check_process_set(process_set: Any) -> None:
    if process_set is not global_process_set and process_set is not None:
        raise NotImplementedError(_NO_PROCESS_SETS)


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
    """Start ringplug (MPI) on all ranks; `comm` and `process_sets` are not supported."""
    if comm is not None or process_sets not in (None, []):
        raise NotImplementedError(
            "ringplug.horovod.init() runs over MPI's world; it takes no "
            "communicator or process sets."
        )
    core.init()


shutdown = core.shutdown
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


def barrier(process_set: Any = _SET) -> None:
    """Wait until every rank has called barrier (torch's and TensorFlow's, not Keras's)."""
    check_process_set(process_set)
    core.barrier()


# ---------------------------------------------------------------------------- Keras and TF
# What ringplug.horovod.keras and ringplug.horovod.tensorflow share beyond the basics (the
# names are each module's own, not in __all__: torch's take other arguments).
def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: Any = _SET,
) -> Any:
    """Root's picklable `obj` on every rank (`session`: Horovod's TF1 argument, unused)."""
    check_process_set(process_set)
    return core.broadcast_object(obj, root_rank, name=name)


def allgather_object(
    obj: Any, session: Any = None, name: str | None = None, process_set: Any = _SET
) -> list[Any]:
    """Every rank's picklable `obj`, as a list in rank order (`session`: unused)."""
    check_process_set(process_set)
    return core.allgather_object(obj, name=name)


def local_layers_variables(local_layers: Any) -> list[Any]:
    """The trainable variables of Horovod's `local_layers` (None, a layer, or a list)."""
    if local_layers is None:
        return []
    layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
    return [variable for layer in layers for variable in layer.trainable_weights]
