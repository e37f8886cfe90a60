"""What the Trainer's `RingStrategy` and Fabric's `RingFabricStrategy` share: Lightning's
conventions for reducing and gathering tensors over the ranks, the rank facts and the
start and end of ringplug on each rank (`RingParallel`), each rank's share of the host's
cores, and how a strategy chooses its launcher and devices.

It lives with Fabric because Fabric is the layer the Trainer is built on (``lightning.pytorch``
imports ``lightning.fabric``, and ``pytorch_lightning`` imports ``lightning_fabric``), so
both strategies, and both of their mirrors, can import it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only

from .. import core
from ..core.ops import ReduceOp
from ..core.runtime import launcher_world_size, refuse_torchrun_world, threads_per_rank
from ..run.launch import rerun
from ..run.launch.processes import framework_rank_variables
from ..torch import allgather, allreduce
from ..torch import backend as torch_backend
from .devices import launched_devices

_OPS = {
    "mean": "average",
    "avg": "average",
    "average": "average",
    "sum": "sum",
    "max": "max",
    "min": "min",
    "product": "product",
}


def reduce_over_ranks(
    tensor: Any,
    reduce_op: Any,
    world_size: int,
    group: Any = None,
    who: str = "RingStrategy.reduce",
) -> Any:
    """Reduce `tensor` over every rank, as Lightning's strategies do ("mean"/"avg", "sum",
    "max", "min", "product", a ringplug or torch.distributed ``ReduceOp``; ``None`` is sum).

    A new tensor on `tensor`'s device; anything but a tensor comes back as it is. As DDP, the
    mean of integers (Lightning's batch-size counters) is a float. Only the world is a group
    here (`group` None or torch.distributed's WORLD): ringplug's ranks form one world.
    """
    if not isinstance(tensor, torch.Tensor):
        return tensor
    _check_group(group, who)
    op = op_name(reduce_op, who)
    local = tensor.detach().cpu()
    if op == "average" and not (local.is_floating_point() or local.is_complex()):
        return (allreduce(local, "sum") / world_size).to(tensor.device)
    return allreduce(local, op).to(tensor.device)


def gather_over_ranks(
    tensor: torch.Tensor,
    sync_grads: bool = False,
    group: Any = None,
    who: str = "RingStrategy.all_gather",
) -> torch.Tensor:
    """Every rank's `tensor` stacked on a new first dimension, as DDP's ``all_gather``;
    differentiable with `sync_grads` (each rank's gradient flows back to its own rows)."""
    _check_group(group, who)
    stacked = tensor.unsqueeze(0)
    if not sync_grads:
        stacked = stacked.detach()
    return allgather(stacked.contiguous())


class RingParallel:
    """The part of a ring strategy that is the same in the Trainer and in Fabric (listed
    before Lightning's ``ParallelStrategy`` among the bases, so that these win)."""

    timeline: str | None
    parallel_devices: list[torch.device] | None
    local_rank: int
    world_size: int
    global_rank: int

    # ------------------------------------------------------------------ rank facts
    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cpu":
            return torch.device("cpu")
        # One rank per GPU, as DDP: local rank i takes device i (the only one when the
        # launcher gave each rank its own CUDA_VISIBLE_DEVICES).
        return devices[self.local_rank] if len(devices) > 1 else devices[0]

    @property
    def num_nodes(self) -> int:
        return getattr(self, "_num_nodes", 1)

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        self._num_nodes = value

    @property
    def num_processes(self) -> int:
        return 1  # one process per device; the launcher decides how many

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _speak_as_rank(self) -> None:
        """Lightning's ``rank_zero_only`` lets this rank through if it is rank 0 (not while
        the ranks of a self-launch replay what their launching process printed already:
        `ringplug.run.launch.rerun`)."""
        if not rerun.replaying():
            rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ start and end
    def _start_ring(self) -> None:
        """ringplug on this rank: the engine, the GPU, the threads, the timeline, and the
        ``ringplug`` process group through which torchmetrics, SyncBatchNorm, Lightning's
        own torch.distributed calls and user code reach the engine."""
        core.init()
        rerun.end_replay(self.global_rank)
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)  # NCCL and the caching allocator follow it
        _split_threads()
        if self.timeline:
            core.start_timeline(self.timeline)
        self._owns_process_group = torch_backend.init_process_group()

    def _stop_ring(self) -> None:
        """Undo what `_start_ring` set up that belongs to this strategy."""
        if self.timeline:
            core.stop_timeline()
        if getattr(self, "_owns_process_group", False):
            dist.destroy_process_group()  # local: the group holds no threads or sockets
            self._owns_process_group = False

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        core.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return core.broadcast_object(obj, src)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,  # type: ignore[attr-defined]
            cls,
            description="Data-parallel training over ringplug's ring",
            override=True,
        )


def know_rank_from_launcher() -> None:
    """Under an MPI launcher that left ``RANK`` unset (a bare ``mpiexec``; ringrun's wrapper
    sets it before the program starts), set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` from
    the launcher's own variables, and Lightning's ``rank_zero_only`` with them: from the
    strategy's construction on, rank-zero logging and code see the true rank (Lightning read
    0 at its import). Reads the environment only: MPI is not started."""
    variables = framework_rank_variables(os.environ)
    if not variables or "RANK" in os.environ:
        return
    for name, value in variables.items():
        os.environ.setdefault(name, value)
    if not rerun.replaying():
        rank_zero_only.rank = int(variables["RANK"])
        # torchmetrics keeps a rank_zero_only of its own, read from LOCAL_RANK at its import.
        prints = sys.modules.get("torchmetrics.utilities.prints")
        if prints is not None and "LOCAL_RANK" in variables:
            prints.rank_zero_only.rank = int(variables["LOCAL_RANK"])


def launched_ranks() -> int:
    """How many ranks an MPI launcher started (1 when none did)."""
    world = launcher_world_size()
    return world[0] if world is not None else 1


def one_copy_per_rank_error(owner: str, strategy: Any, ranks: int) -> RuntimeError:
    """The error for a Trainer or Fabric that would train one copy per rank."""
    name = type(strategy).__name__
    return RuntimeError(
        f"The MPI launcher (ringrun) started {ranks} ranks, but this {owner} trains in its own "
        f"process alone ({name}): the {ranks} ranks would each train a separate copy of the "
        f"model. Use {owner}(strategy='ring') (or leave strategy at its default: under ringrun "
        f"it is 'ring'), or start one rank (ringrun -np 1) to train in one process."
    )


def _split_threads() -> None:
    """Give each of the N ranks on a host 1/N of its cores for torch's intra-op threads
    (left alone when OMP_NUM_THREADS says how many)."""
    share = threads_per_rank()
    if share is not None and torch.get_num_threads() > share:
        torch.set_num_threads(share)


def op_name(reduce_op: Any, who: str = "RingStrategy.reduce") -> str:
    """The ringplug name of a Lightning / torch.distributed / ringplug reduce op."""
    if reduce_op is None:
        return "sum"  # torch.distributed's default, and Fabric's for None
    if isinstance(reduce_op, ReduceOp):
        return reduce_op.name.lower()
    if isinstance(reduce_op, str):
        name = _OPS.get(reduce_op.lower())
        if name is not None:
            return name
    name = getattr(reduce_op, "name", str(reduce_op)).lower()  # torch.distributed.ReduceOp
    for key, value in _OPS.items():
        if name.endswith(key):
            return value
    raise ValueError(
        f"{who}: unsupported reduce_op {reduce_op!r}; use 'mean', 'sum', 'max' or 'min'."
    )


def _check_group(group: Any, who: str) -> None:
    if group is None or (dist.is_available() and group is dist.group.WORLD):
        return
    raise ValueError(
        f"{who}: group={group!r} is not supported; ringplug reduces over every rank of the "
        "job. Leave group at its default (None)."
    )


def configure_launcher(strategy: Any, launcher: Any, owner: str) -> Any:
    """The launcher `strategy` (RingStrategy or RingFabricStrategy) needs, or None; under an
    MPI launcher, also its devices (one GPU per rank by default, see devices.py).

    `launcher` is the RingLauncher class of the strategy's package; `owner` names what the
    user configures ("Trainer", "Fabric") in the error for an unsupported device type.
    """
    devices = {device.type for device in strategy.parallel_devices or []}
    if devices - {"cpu", "cuda"}:
        raise NotImplementedError(
            f"{type(strategy).__name__} trains on CPUs and CUDA GPUs, not on "
            f"{sorted(devices)}; use {owner}(accelerator='cpu') or accelerator='gpu' with "
            "strategy='ring'."
        )
    refuse_torchrun_world()  # each torchrun worker would otherwise start its own job
    requested = len(strategy.parallel_devices or [])
    if launcher_world_size() is not None:
        # Started by ringrun / mpiexec / srun: the launcher's world is the job, and
        # devices="auto" on GPUs means cuda:LOCAL_RANK.
        core.init()
        strategy.parallel_devices = launched_devices(
            strategy.parallel_devices or [],
            visible_gpus=torch.cuda.device_count(),
            local_rank=strategy.local_rank,
            local_size=core.local_size(),
            world_size=strategy.world_size,
            num_nodes=strategy.num_nodes,
            owner=owner,
        )
        return None
    if requested > 1:
        return launcher(requested)  # `python train.py`: start the ranks
    return None  # one process: a world of one
