"""RingEnvironment: Lightning's view of a job whose ranks an MPI launcher started (the Trainer's
and Fabric's: they share the cluster-environment class)."""

from __future__ import annotations

from lightning.fabric.plugins.environments import ClusterEnvironment

from .. import core
from ..core.runtime import launcher_world_size


class RingEnvironment(ClusterEnvironment):
    """Ranks and sizes from ringplug's MPI world (ringrun, mpiexec, mpirun or srun started
    the processes; Lightning must not start more)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"  # ringplug bootstraps over MPI; no rendezvous address is used

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return launcher_world_size() is not None

    def world_size(self) -> int:
        core.init()
        return core.size()

    def set_world_size(self, size: int) -> None:
        if size != self.world_size():
            raise ValueError(
                f"Lightning asked for {size} processes, but the MPI launcher started "
                f"{self.world_size()}; leave `devices` and `num_nodes` at their defaults under "
                "ringrun/mpiexec, or start as many ranks as devices x num_nodes."
            )

    def global_rank(self) -> int:
        core.init()
        return core.rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # the MPI world decides

    def local_rank(self) -> int:
        core.init()
        return core.local_rank()

    def node_rank(self) -> int:
        core.init()
        return core.cross_rank()
